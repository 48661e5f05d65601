"""Study files: TOML/YAML loading, validation (one ConfigError naming the field and the fix)."""

from __future__ import annotations

import textwrap

import pytest
import yaml
from conftest import ROOT

from dptune.errors import ConfigError
from dptune.tune import load_study_config, study_from_dict
from dptune.tune.spec import Study

GOOD = textwrap.dedent("""
    [study]
    name = "spec-test"
    seed = 1
    seeds = [0, 1]

    [data]
    name = "digits"
    options = { flatten = true }

    [model]
    name = "logistic_regression"

    [training]
    epochs = 2
    expected_batch_size = 64

    [budget]
    epsilon = [1.0, 3.0]
    delta = 1e-5

    [method]
    name = "grid"

    [selection]
    mode = "public"
    eval_every = 20

    [[strategies]]
    name = "dpsgd"
    space = { lr = [0.1, 1.0], clip = [0.5, 1.0] }
    fixed = { momentum = 0.0 }

    [[strategies]]
    name = "online"
    space = { lr = [0.1, 1.0] }
    method = { name = "online" }
""")


def _write(tmp_path, text, name="study.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_toml_loads_and_round_trips(tmp_path):
    s = load_study_config(_write(tmp_path, GOOD))
    assert isinstance(s, Study)
    assert s.budget.epsilon == (1.0, 3.0) and s.seeds == (0, 1) and s.seed == 1
    assert [a.name for a in s.strategies] == ["dpsgd", "oso"]  # 'online' is OSO's alias
    assert s.method_for(s.strategies[1]).name == "online"
    again = study_from_dict({k: v for k, v in s.to_dict().items()})
    assert again.fingerprint() == s.fingerprint()


def test_yaml_equivalent(tmp_path):
    import tomllib

    d = tomllib.loads(GOOD)
    p = _write(tmp_path, yaml.safe_dump(d), "study.yaml")
    assert load_study_config(p).fingerprint() == load_study_config(_write(tmp_path, GOOD)).fingerprint()


def _bad(tmp_path, old, new):
    assert old in GOOD
    with pytest.raises(ConfigError) as ei:
        load_study_config(_write(tmp_path, GOOD.replace(old, new, 1)))
    return str(ei.value)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('name = "dpsgd"', 'name = "sgd-magic"', "strategies[0].name"),
        ('[method]\nname = "grid"', '[method]\nname = "bayesian"', "method.name"),
        ("space = { lr = [0.1, 1.0], clip = [0.5, 1.0] }", "space = {}", "strategies[0].space"),
        ("space = { lr = [0.1, 1.0], clip = [0.5, 1.0] }", "space = { lr = [] }", "strategies[0].space.lr"),
        ("epsilon = [1.0, 3.0]", "epsilon = 0", "budget.epsilon"),
        ("epsilon = [1.0, 3.0]", "epsilon = [1.0, -2.0]", "budget.epsilon[1]"),
        ("delta = 1e-5", "delta = 1.5", "budget.delta"),
        ("delta = 1e-5", "delta = 0", "budget.delta"),
        ('name = "digits"', 'name = "cifar1000"', "data.name"),
        ('name = "logistic_regression"', 'name = "resnet9000"', "model.name"),
        ("delta = 1e-5", "delta = 1e-5\nepsilom = 2", "budget.epsilom"),
        ('mode = "public"', 'mode = "secret"', "selection.mode"),
        ("fixed = { momentum = 0.0 }", "fixed = { warp = 9 }", "strategies[0].fixed.warp"),
        (
            "space = { lr = [0.1, 1.0], clip = [0.5, 1.0] }",
            "space = { lr = { log_uniform = [0.1, 1.0] } }",
            "strategies[0].space.lr",
        ),
        (
            'space = { lr = [0.1, 1.0] }\nmethod = { name = "online" }',
            'space = { lr = [0.1, 1.0], initial_clip = [1.0] }\nmethod = { name = "online" }',
            "strategies[1].space",
        ),
        ('[method]\nname = "grid"', '[method]\nname = "liu-talwar"\ngamma = 2', "method.gamma"),
        ('[method]\nname = "grid"', '[method]\nname = "liu-talwar"\ngamma = 1e-9', "method.gamma"),  # hours of draws
        ('[method]\nname = "grid"', '[method]\nname = "repeat-and-select"\nmean = 1e9', "method.mean"),
        ("seeds = [0, 1]", "seeds = [0, 0]", "study.seeds"),
        ("epochs = 2", "epochs = 2\nsteps = 10", "training"),
    ],
)
def test_bad_files_give_one_clear_error(tmp_path, old, new, field):
    msg = _bad(tmp_path, old, new)
    assert msg.startswith(field + ":"), msg
    assert "Fix:" in msg


def test_a_bad_batch_size_is_told_a_batch_size(tmp_path) -> None:  # not "e.g. 1.0" (found in review)
    assert "set training.expected_batch_size to e.g. 256" in _bad(
        tmp_path, "expected_batch_size = 64", "expected_batch_size = -1"
    )


def test_missing_sections_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^strategies: section missing"):
        study_from_dict(
            {"data": {"name": "digits"}, "model": {"name": "mlp"}, "training": {"steps": 1, "full_batch": True}}
        )
    with pytest.raises(ConfigError, match="does not exist"):
        load_study_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_study_config(_write(tmp_path, "[study\nname="))
    with pytest.raises(ConfigError, match="unknown file type"):
        load_study_config(_write(tmp_path, GOOD, "study.json"))


def test_strategy_hyperparameters_are_validated_early(tmp_path):
    msg = _bad(tmp_path, "space = { lr = [0.1, 1.0], clip = [0.5, 1.0] }", "space = { lr = [-1.0] }")
    assert msg.startswith("strategies[0]") and "lr" in msg


def test_the_documented_example_is_a_valid_study(tmp_path):
    import re

    doc = (ROOT / "docs" / "tuning.md").read_text()
    block = re.search(r"```toml\n(.*?)```", doc, re.S).group(1)
    s = load_study_config(_write(tmp_path, block))
    assert [a.name for a in s.strategies] == ["dpsgd", "oso", "nodp"]
    assert s.budget.epsilon == (1.0, 3.0) and s.selection.split == "holdout"
