"""Your own CSV file (dptune.data.tabular): `dptune train --data FILE.csv --label COLUMN`, the same in a
study's [data], a public schema that is never fitted on the rows, and one clear error per bad file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import one_error_line
from typer.testing import CliRunner

from dptune.cli import app
from dptune.data.tabular import load_csv
from dptune.errors import ConfigError, DataError
from dptune.tune.data import study_data
from dptune.tune.spec import load_study_config


def write_csv(path: Path, n: int, seed: int) -> Path:
    """x1 in [-1, 1] decides the label (pos iff x1 > 0); shape is categorical, x2 in [0, 10] is noise."""
    rng = np.random.default_rng(seed)
    lines = ["x1,shape,x2,y"]
    for _ in range(n):
        x1, shape, x2 = rng.uniform(-1, 1), rng.choice(["round", "square"]), rng.uniform(0, 10)
        lines.append(f"{x1:.3f},{shape},{x2:.2f},{'pos' if x1 > 0 else 'neg'}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_numeric_categorical_and_string_labels(tmp_path: Path) -> None:
    f = tmp_path / "f.csv"
    f.write_text("x1,shape,x2,y\n0.5,square,20,pos\n-1,round,-5,neg\n3,round,4,pos\n")
    ds = load_csv(str(f), label="y", categories={"shape": ["round", "square"]}, numeric={"x2": [0, 10]})
    # x1 as it is (no bounds), shape one-hot in the declared order, x2 clipped to [0, 10] and scaled
    want = [[0.5, 0, 1, 1.0], [-1, 1, 0, 0.0], [3, 1, 0, 0.4]]
    assert torch.allclose(ds.x_train, torch.tensor(want, dtype=torch.float32))
    assert ds.y_train.tolist() == [1, 0, 1] and ds.class_names == ("neg", "pos") and ds.num_classes == 2
    assert ds.n_test == 0 and ds.input_shape == (4,)
    assert "x1: numeric, as it is (no declared bounds: no scaling)" in ds.notes
    assert (
        "(the sorted distinct values of the files, not declared: not differentially private: for the data owner only)"
        in ds.notes
    )
    # declared labels: their order, even with a class absent from the file
    ds = load_csv(str(f), label="y", categories={"shape": ["round", "square"]}, labels=["pos", "neg", "maybe"])
    assert ds.y_train.tolist() == [0, 1, 0] and ds.num_classes == 3 and "(declared)" in ds.notes
    # numeric labels sort as numbers, not as strings
    g = tmp_path / "g.csv"
    g.write_text("a,y\n1,10\n2,2\n3,1\n")
    assert load_csv(str(g), label="y").class_names == ("1", "2", "10")


def test_schema_is_not_fitted_on_the_rows(tmp_path: Path) -> None:
    """Changing one private row changes that row's encoding only: same columns, same scaling of the others."""
    a, b = write_csv(tmp_path / "a.csv", 50, 0), tmp_path / "b.csv"
    lines = a.read_text().splitlines()
    lines[7] = "0.999,square,1000,pos"  # an outlier far beyond the declared bounds of x2
    b.write_text("\n".join(lines) + "\n")
    decl = {"categories": {"shape": ["round", "square"]}, "numeric": {"x2": [0, 10]}}
    da, db = load_csv(str(a), label="y", **decl), load_csv(str(b), label="y", **decl)
    assert da.notes == db.notes and da.input_shape == db.input_shape
    differ = (da.x_train != db.x_train).any(dim=1)
    assert differ.nonzero().reshape(-1).tolist() == [6]  # line 8 of the file: example 6
    assert db.x_train[6, 3] == 1.0  # clipped to hi, not min-max scaled on the data


def test_cli_end_to_end_learns_a_separable_toy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tr, te = write_csv(tmp_path / "tr.csv", 1500, 1), write_csv(tmp_path / "te.csv", 300, 2)
    schema = tmp_path / "schema.toml"
    schema.write_text('categories = { shape = ["round", "square"] }\nnumeric = { x2 = [0, 10] }\n')
    out = tmp_path / "r.json"
    args = ["train", "--data", str(tr), "--label", "y", "--test", str(te), "--schema", str(schema)]
    args += ["--epochs", "3", "--batch-size", "64", "--epsilon", "8", "--no-progress", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.output, res.exception)
    assert "one-hot over the declared categories ['round', 'square']" in caplog.text  # the schema is said
    diag = json.loads((tmp_path / "diagnostics" / "r.json").read_text())
    assert diag["private_evaluation"]["best_metric"] > 0.9  # the test CSV is private by default
    # The final parameters are the model (a private split selects nothing): their score is printed too, labelled
    # (found in review: only the best, which the delivered model did not have)
    text = " ".join(res.output.split())
    assert "final accuracy (not differentially private: for the data owner only)" in text, text


def test_study_toml_csv(tmp_path: Path) -> None:
    write_csv(tmp_path / "f.csv", 200, 3)
    (tmp_path / "study.toml").write_text(
        '[data]\ncsv = "f.csv"\nlabel = "y"\ncategories = { shape = ["round", "square"] }\n'
        '[model]\nname = "logistic_regression"\n[training]\nepochs = 1\nexpected_batch_size = 32\n'
        '[budget]\nepsilon = 3.0\ndelta = 1e-5\n[selection]\nsplit = "holdout"\nmode = "private"\n'
        '[[strategies]]\nname = "dpsgd"\nspace = { lr = [0.1, 1.0] }\n'
    )
    study = load_study_config(tmp_path / "study.toml")  # relative file names: from the study's folder
    assert study.data.factory == "dptune.data.tabular:load_csv" and study.data.test_public is False
    assert study.data.options["csv"] == str(tmp_path / "f.csv")
    d = study_data(study.data, study.selection, 0)
    assert (d.n_train + d.n_val, d.num_classes, d.input_shape) == (200, 2, (4,))
    # Found in review: a resume read another file (or the file changed) with the planned q and guarantee.
    from dptune.tune import resume_study, run_study

    run_study(study, tmp_path / "s", progress=False)
    for n, seed, which in ((300, 3, ""), (200, 4, "rows that differ: training, validation")):  # then other values
        write_csv(tmp_path / "f.csv", n, seed)
        study_data.__globals__["_CACHE"].clear()  # as a new process (`dptune resume`) reads it
        with pytest.raises(ConfigError, match=f"not the one it was planned on: .* planned.*{which}"):
            resume_study(tmp_path / "s", progress=False)
    write_csv(tmp_path / "f.csv", 200, 3)  # the planned file again: resumed
    study_data.__globals__["_CACHE"].clear()
    assert resume_study(tmp_path / "s", progress=False).complete


@pytest.mark.parametrize(
    ("text", "label", "needle"),
    [
        ("x1,y\n1,a\n", "z", "no label column 'z'"),
        (
            "x1,y\n1,a\nabc,b\n",
            "y",
            "line 3: column 'x1' holds 'abc' (a value of your data: not differentially private: for the data owner only), not a finite number",
        ),
        ("", "y", "holds no data rows"),
        ("x1,y\n", "y", "holds no data rows"),
        ("x1,y\n1,a\n2\n", "y", "line 3: 1 fields"),
        (
            "x1,c,y\n1,red,a\n",
            "y",
            "column 'c' holds 'red' (a value of your data: not differentially private: for the data owner only), not a finite number",
        ),  # undeclared categories: refused
        ("x1,y\n1,a\n2,a\n", "y", "the label column 'y' holds 1 distinct value"),
        # found in review: lines counted with blank lines; float32 overflow; empty label; two spellings; no feature
        ("x1,y\n\n1,a\n\n\nfoo,b\n", "y", "line 6: column 'x1' holds 'foo'"),
        ("x1,y\n1,a\n\n2\n", "y", "line 4: 1 fields, the header has 2. Fix: give every line 2 fields"),
        ("x1,y\n1,a\n1e39,b\n", "y", "line 3: column 'x1' holds '1e39'"),
        ("x1,y\n1,a\n2,\n3,b\n", "y", "line 3: the label cell is empty"),
        ("x1,y\n1,1\n2,1.0\n3,2\n", "y", "spells one number in two ways"),
        ("y\na\nb\n", "y", "holds only the label column 'y'"),
    ],
)
def test_bad_csv_is_one_clear_error(tmp_path: Path, text: str, label: str, needle: str) -> None:
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(DataError, match=None) as err:
        load_csv(str(f), label=label)
    assert needle in str(err.value)
    line = one_error_line(["train", "--data", str(f), "--label", label, "--no-progress", "--out", str(tmp_path / "r")])
    assert needle in line


@pytest.mark.parametrize("bounds", [[float("-inf"), 120], [0, float("inf")], [-1e308, 1e308], ["0", "x"], [3, 3]])
def test_numeric_bounds_must_be_finite_and_ordered(tmp_path: Path, bounds: list) -> None:
    """An infinite bound, or an infinite width, made NaN or all-zero features and a run that spent its ε on
    them (found in review); a bound that is not a number was a bare ValueError."""
    f = tmp_path / "f.csv"
    f.write_text("age,y\n30,a\n40,b\n")
    with pytest.raises(DataError, match="Fix: declare finite public bounds"):
        load_csv(str(f), label="y", numeric={"age": bounds})


def test_a_study_keeps_declared_labels_absent_from_the_file(tmp_path: Path) -> None:
    """The study's class count is the declared one, as `load_csv`'s: read from the labels, a released model's
    width showed that no example has the last declared label (found in review)."""
    write_csv(tmp_path / "f.csv", 60, 3)  # labels pos / neg only
    (tmp_path / "study.toml").write_text(
        '[data]\ncsv = "f.csv"\nlabel = "y"\nlabels = ["neg", "pos", "maybe"]\n'
        'categories = { shape = ["round", "square"] }\n[model]\nname = "logistic_regression"\n'
        "[training]\nepochs = 1\nexpected_batch_size = 8\n[budget]\nepsilon = 3.0\ndelta = 1e-5\n"
        '[selection]\nsplit = "holdout"\nmode = "private"\n[[strategies]]\nname = "dpsgd"\nspace = { lr = [0.1] }\n'
    )
    study = load_study_config(tmp_path / "study.toml")
    assert study_data(study.data, study.selection, 0).num_classes == 3


def test_csv_options_go_together(tmp_path: Path) -> None:
    assert "go together" in one_error_line(["train", "--data", "f.csv"])
    assert "go together" in one_error_line(["train", "--label", "y"])
    (tmp_path / "typo.toml").write_text('categoires = { shape = ["round", "square"] }\n')
    with pytest.raises(ConfigError, match=r"unknown schema declaration\(s\) \['categoires'\]"):
        load_csv(str(write_csv(tmp_path / "t.csv", 5, 0)), label="y", schema=str(tmp_path / "typo.toml"))
    missing = one_error_line(["train", "--data", str(tmp_path / "none.csv"), "--label", "y"])
    assert "cannot read the CSV file" in missing and "none.csv" in missing
    with pytest.raises(DataError, match="not one of the declared labels"):
        load_csv(
            str(write_csv(tmp_path / "g.csv", 5, 0)),
            label="y",
            labels=["pos"],
            categories={"shape": ["round", "square"]},
        )
    with pytest.raises(DataError, match="not a feature column"):
        load_csv(str(write_csv(tmp_path / "h.csv", 5, 0)), label="y", numeric={"y": [0, 1]})
    with pytest.raises(DataError, match="not one of its declared categories"):
        load_csv(str(write_csv(tmp_path / "f.csv", 5, 0)), label="y", categories={"shape": ["round"]})


def test_a_resume_refuses_a_changed_test_split(tmp_path: Path) -> None:
    """Holdout selection with a separate test CSV: its rows are in the data digest too (found in review: a resume
    on a label-flipped test file mixed test metrics of two test sets)."""
    from dptune.tune import resume_study, run_study

    write_csv(tmp_path / "f.csv", 200, 3)
    write_csv(tmp_path / "t.csv", 60, 5)
    (tmp_path / "study.toml").write_text(
        '[data]\ncsv = "f.csv"\ntest = "t.csv"\ntest_public = true\nlabel = "y"\n'
        'categories = { shape = ["round", "square"] }\n'
        '[model]\nname = "logistic_regression"\n[training]\nepochs = 1\nexpected_batch_size = 32\n'
        '[budget]\nepsilon = 3.0\ndelta = 1e-5\n[selection]\nsplit = "holdout"\nmode = "private"\n'
        '[[strategies]]\nname = "dpsgd"\nspace = { lr = [0.1, 1.0] }\n'
    )
    study = load_study_config(tmp_path / "study.toml")
    run_study(study, tmp_path / "s", progress=False)
    write_csv(tmp_path / "t.csv", 60, 6)  # other test rows, same count
    study_data.__globals__["_CACHE"].clear()
    with pytest.raises(ConfigError, match="not the one it was planned on: .*rows that differ: test"):
        resume_study(tmp_path / "s", progress=False)
