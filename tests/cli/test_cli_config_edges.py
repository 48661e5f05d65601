"""Study files and CLI options that were silently accepted or answered with a misleading line
(issue 13): each is one clear error naming the fix, exit code 2, no traceback, no folder made."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dptune.cli import app
from dptune.presets import preset_parts
from dptune.tune import load_study_config, plan_only

# A tiny study (digits, 2 steps, one configuration): every refusal below happens before it runs.
SECTIONS: dict[str, dict[str, str]] = {
    "study": {"name": '"edges"'},
    "data": {"name": '"digits"', "options": "{ flatten = true }"},
    "model": {"name": '"logistic_regression"'},
    "training": {"steps": "2", "expected_batch_size": "64"},
    "budget": {"epsilon": "3.0", "delta": "1e-5"},
}
STRATEGY = '[[strategies]]\nname = "dpsgd"\nspace = { lr = [0.1] }\n'


def study_toml(tmp_path: Path, edits: dict[str, dict[str, str | None]] | None = None, name: str = "s.toml") -> Path:
    """SECTIONS with ``edits`` applied (section → key → TOML value, None drops the key)."""
    sections = {k: dict(v) for k, v in SECTIONS.items()}
    for sec, kv in (edits or {}).items():
        for key, value in kv.items():
            if value is None:
                sections.setdefault(sec, {}).pop(key, None)
            else:
                sections.setdefault(sec, {})[key] = value
    text = "".join(f"[{sec}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items()) + "\n" for sec, kv in sections.items())
    path = tmp_path / name
    path.write_text(text + STRATEGY)
    return path


def invoke(*args: str | Path) -> tuple[int, str]:
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


def assert_refused(rc: int, output: str, *fragments: str) -> None:
    """Exit code 2, one 'error:' line naming the fix, each fragment in it, no traceback."""
    assert rc == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Fix:" in errors[0], output
    for f in fragments:
        assert f in errors[0], (f, output)


# ----------------------------------------------------------------------------- a. device
def test_tune_refuses_an_unknown_device_before_making_the_study_folder(tmp_path: Path) -> None:
    cfg = study_toml(tmp_path, {"training": {"device": '"tpu"'}})
    rc, out = invoke("tune", cfg, "-o", tmp_path / "out", "--no-progress")
    assert_refused(rc, out, "training.device", "unknown device 'tpu'", "use cpu, cuda, cuda:N or mps")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_tune_refuses_cuda_on_a_machine_without_it(tmp_path: Path) -> None:
    cfg = study_toml(tmp_path, {"training": {"device": '"cuda"'}})
    rc, out = invoke("tune", cfg, "-o", tmp_path / "out", "--no-progress")
    assert_refused(rc, out, "training.device", "CUDA is not available here", "use device 'cpu'")
    assert not (tmp_path / "out").exists()


def test_reproduce_refuses_an_unknown_device_before_making_the_folder(tmp_path: Path) -> None:
    rc, out = invoke("reproduce", "galli-mnist", "--device", "tpu", "--out", tmp_path / "r", "--no-progress")
    assert_refused(rc, out, "unknown device 'tpu'")
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- b. study name
@pytest.mark.parametrize("bad", ["../escape", "a/b", "..", "a/../b", ".hidden", "a\\\\b", "with space", ""])
def test_a_study_name_that_is_not_one_folder_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.chdir(tmp_path)  # the default study folder is studies/<name> under the working directory
    cfg = study_toml(tmp_path, {"study": {"name": f'"{bad}"'}})
    rc, out = invoke("tune", cfg, "--no-progress")
    assert_refused(rc, out, "study.name", "letters, digits", "no '..'", 'name = "mnist-dpsgd"')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]  # neither studies/ nor escape/


def test_a_study_name_of_letters_digits_dashes_underscores_and_dots_is_accepted(
    tmp_path: Path,
) -> None:
    assert load_study_config(study_toml(tmp_path, {"study": {"name": '"mnist-dpsgd_v1.2"'}})).name == "mnist-dpsgd_v1.2"


# ----------------------------------------------------------------------------- c. --workers
@pytest.mark.parametrize("workers", ["0", "-1"])
def test_workers_below_one_are_refused_by_tune_resume_and_reproduce(tmp_path: Path, workers: str) -> None:
    cfg = study_toml(tmp_path)
    out_dir = tmp_path / "out"
    for args in (
        ["tune", cfg, "-o", out_dir, "--executor", "process"],
        ["tune", cfg, "-o", out_dir],  # the local executor ignores it, but 0 is still a mistake
        ["resume", out_dir, "--executor", "process"],
        ["reproduce", "galli-mnist", "--out", out_dir, "--executor", "process"],
    ):
        rc, out = invoke(*args, "--workers", workers, "--no-progress")
        assert_refused(rc, out, f"workers must be an integer ≥ 1, got {workers}", "--workers 2")
        assert not out_dir.exists(), args


# ----------------------------------------------------------------------------- d. Galli's k per scale
@pytest.mark.parametrize(
    ("scale", "k", "fragment"),
    [
        ("paper", "4", "k = 4 is not one of the paper's values [5, 7, 9] (the paper scale"),
        ("gpu-slice", "6", "k = 6 is not one of the paper's values [5, 7, 9] (the gpu-slice scale"),
        ("smoke", "12", "k = 12 is not allowed at the smoke scale: it takes 1 to 9"),
        ("small", "0", "k = 0 is not allowed at the small scale: it takes 1 to 9"),
    ],
)
def test_reproduce_checks_k_against_the_values_of_its_scale(tmp_path: Path, scale: str, k: str, fragment: str) -> None:
    rc, out = invoke(
        "reproduce",
        "galli-mnist",
        "--scale",
        scale,
        "--k",
        k,
        "--device",
        "cpu",
        "--out",
        tmp_path / "r",
        "--no-progress",
    )
    assert_refused(rc, out, fragment)
    assert not (tmp_path / "r").exists()


def test_reduced_scales_take_any_k_up_to_nine_as_their_grid_size() -> None:
    """smoke/small grids are checks, smaller than the paper's: k = 4 gives 4 learning rates."""
    study = preset_parts("galli-mnist", "smoke", k=4)[0].study
    dpsgd = next(s for s in study["strategies"] if s["name"] == "dpsgd")
    assert len(dpsgd["space"]["lr"]) == 4 and len(dpsgd["space"]["clip"]) == 4


# ----------------------------------------------------------------------------- e. resume of a finished study
def test_resume_of_a_complete_study_says_so_and_runs_nothing(tmp_path: Path) -> None:
    cfg = study_toml(tmp_path)
    out_dir = tmp_path / "out"
    rc, out = invoke("tune", cfg, "-o", out_dir, "--no-progress")
    assert rc == 0, out
    db = out_dir / "study.sqlite"
    before = db.stat().st_mtime_ns
    rc, out = invoke("resume", out_dir, "--no-progress")
    assert rc == 0, out
    assert "already complete: nothing to resume" in out and f"dptune report {out_dir}" in out, out
    assert "selected" not in out  # no results table printed as if it had resumed
    assert db.stat().st_mtime_ns == before  # the store was not opened for writing


# ----------------------------------------------------------------------------- f. a directory as the study file
def test_a_directory_given_as_the_study_file_is_called_a_directory(tmp_path: Path) -> None:
    (tmp_path / "study.toml").mkdir()
    rc, out = invoke("tune", tmp_path / "study.toml", "-o", tmp_path / "out")
    assert_refused(rc, out, "is a directory, not a file", "pass the path of a .toml or a .yaml file")
    assert "does not exist" not in out
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- g. ε as a string
def test_epsilon_given_as_a_word_is_named_whole(tmp_path: Path) -> None:
    cfg = study_toml(tmp_path, {"budget": {"epsilon": '"three"'}})
    rc, out = invoke("tune", cfg, "-o", tmp_path / "out")
    assert_refused(
        rc,
        out,
        "budget.epsilon: must be a number or a list of numbers, got 'three'",
        "epsilon = 3.0",
    )
    assert "'t'" not in out
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- h. typos in keys and sections
def test_a_strategy_error_ending_in_a_period_gets_no_second_one(tmp_path: Path) -> None:
    """Found in an audit: "got -0.1.. Fix" (config_error appended ". Fix" to a message ending in a period)."""
    path = study_toml(tmp_path)
    path.write_text(path.read_text().replace("lr = [0.1]", "lr = [-0.1]"))
    rc, output = invoke("tune", path, "--out", tmp_path / "o")
    assert_refused(rc, output, "lr must be a finite number > 0, got -0.1. Fix:")
    assert ".." not in output and not (tmp_path / "o").exists()


def test_a_mistyped_key_names_its_section_and_the_close_match(tmp_path: Path) -> None:
    cfg = study_toml(tmp_path, {"budget": {"epsilon": None, "epsilonn": "3.0"}})
    rc, out = invoke("tune", cfg, "-o", tmp_path / "out")
    # "[budget]" once vanished: rich read it as markup
    assert_refused(
        rc,
        out,
        "budget.epsilonn: unknown key in [budget]; did you mean epsilon?",
        "rename it to 'epsilon'",
        "the keys of [budget]: account_seeds, accountant, allow_large_delta, delta, epsilon",
    )
    assert not (tmp_path / "out").exists()


def test_a_mistyped_section_suggests_the_close_match_and_an_unrelated_key_lists_the_keys(
    tmp_path: Path,
) -> None:
    cfg = study_toml(tmp_path)
    cfg.write_text(cfg.read_text().replace("[budget]", "[budgett]"))
    rc, out = invoke("tune", cfg, "-o", tmp_path / "out")
    assert_refused(rc, out, "budgett: unknown section [budgett]; did you mean budget?")
    cfg = study_toml(tmp_path, {"training": {"colour": '"blue"'}})
    rc, out = invoke("tune", cfg, "-o", tmp_path / "out")
    assert_refused(
        rc,
        out,
        "training.colour: unknown key in [training]. Fix: remove it, or use one of the keys of [training]:",
    )
    assert "did you mean" not in out
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- i. YAML 1.1 floats
def test_yaml_exponent_floats_without_a_dot_are_numbers(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) reads 1e-5 as the string '1e-5'; study files read it as TOML would."""
    path = tmp_path / "s.yaml"
    path.write_text(
        textwrap.dedent("""\
        study: {name: edges}
        data: {name: digits, options: {flatten: true}}
        model: {name: logistic_regression}
        training: {steps: 2, expected_batch_size: 64}
        budget:
          epsilon: [3, 1E+1]
          delta: 1e-5
        selection: {mode: private, split: holdout, noise_multiplier: 2e1}
        strategies:
          - {name: dpsgd, space: {lr: [1e-1, 0.5]}}
    """)
    )
    study = load_study_config(path)
    assert study.budget.delta == 1e-5 and study.budget.epsilon == (3.0, 10.0)
    assert study.selection.noise_multiplier == 20.0
    assert study.strategies[0].space["lr"] == [0.1, 0.5]
    # a quoted value stays a string: one clear error, not a silent conversion
    path.write_text(path.read_text().replace("delta: 1e-5", 'delta: "1e-5"'))
    rc, out = invoke("tune", path, "-o", tmp_path / "out")
    assert_refused(rc, out, "budget.delta", "got '1e-5'")


# ----------------------------------------------------------------------------- j. Liu–Talwar and private selection
def test_liu_talwar_with_private_scores_that_exceed_a_runs_share_says_why_and_how_much(
    tmp_path: Path,
) -> None:
    edits = {
        "training": {"steps": "50"},
        "budget": {"epsilon": "1.0"},
        "method": {"name": '"lt"'},
        "selection": {"mode": '"private"', "eval_every": "1"},
    }
    cfg = study_toml(tmp_path, edits)
    cfg.write_text(cfg.read_text().replace("lr = [0.1]", "lr = [0.1, 0.2]"))
    rc, out = invoke("tune", cfg, "-o", tmp_path / "out", "--no-progress")
    assert_refused(
        rc,
        out,
        "Liu–Talwar gives each candidate run ε₁ = 0.3333",
        "50 private validation scores (selection.mode = 'private', σ = 20) alone spend",
        "raise selection.noise_multiplier to ≥",
        "selection.eval_every",
        "selection.mode = 'public'",
    )
    assert "non-private" not in out
    assert not (tmp_path / "out").exists(), "a planning error left a half-made study folder (run_study)"
    # The suggested noise level is enough: the same study then plans.
    sigma = re.search(r"selection\.noise_multiplier to ≥ ([0-9.e+]+)", out).group(1)
    cfg.write_text(cfg.read_text().replace("eval_every = 1", f"eval_every = 1\nnoise_multiplier = {sigma}"))
    plan = plan_only(cfg)
    assert plan.arms[0].method == "liu-talwar" and plan.runs


def test_a_presets_study_dict_runs_as_docs_reproduce_md_says(tmp_path: Path) -> None:
    """Found in review: docs/reproduce.md says to edit ``preset_parts(...)[0].study_dict()`` and run that dict with
    ``dptune.tune.run_study``, which raised a TypeError (a path was expected)."""
    from dptune.errors import ConfigError
    from dptune.tune import run_study
    from dptune.tune.spec import load_study_config

    d = preset_parts("galli-mnist", "smoke", k=2)[0].study_dict()
    assert load_study_config(d) == load_study_config(preset_parts("galli-mnist", "smoke", k=2)[0].study_dict())
    with pytest.raises(ConfigError):  # a dict is read as a study file is: a bad value is one clear error
        run_study({**d, "budget": {**d["budget"], "epsilon": [-1.0]}}, tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()
