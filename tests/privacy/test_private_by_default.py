"""Private by default (issue 23, items 7 and 8a).

* The user's own evaluation data is private unless declared public: ``dptune train --data`` and
  ``dptune.train(eval_data=...)`` release the FINAL iterate (no selection on private data), keep
  every metric on that data out of the release (diagnostics only, labelled) and say so on the card;
  ``best`` needs ``--eval-public`` / ``eval_public=True``. A built-in dataset's test split is public.
* δ ≥ 1/n is refused, unless allowed explicitly, by ``train``, ``make_private``, the CLI and studies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import OWN_FACTORIES, invoke_train, one_error_line
from tune_helpers import own_factories_study_toml

import dptune
from dptune import ConfigError, deliverable
from dptune.outputs import NOT_DP_LABEL
from dptune.tune import load_study_config, run_study
from dptune.tune.store import Store
from dptune.tune.study import plan_only

OWN = ["--epochs", "1", "--batch-size", "40", "--eval-every", "2", "--hp", "lr=0.5"]


def _own_run(tmp_path: Path, *extra: str):
    """`dptune train --data own_factories:...` into tmp/release/r.json, saved to tmp/model."""
    out, save = tmp_path / "release" / "r.json", tmp_path / "model"
    res = invoke_train(
        out, "--save", str(save), *extra, data=OWN_FACTORIES, epochs="1", batch_size="40", hps=["lr=0.5"]
    )
    assert res.exit_code == 0, (res.output, res.exception)
    card = json.loads((save / deliverable.CARD_JSON).read_text())
    return json.loads(out.read_text()), json.loads((tmp_path / "diagnostics" / "r.json").read_text()), card


def test_cli_own_data_releases_the_final_iterate_and_no_metric_on_the_private_test_split(tmp_path):
    release, diag, card = _own_run(tmp_path)
    assert release["checkpoint"] == "final" and release["eval_public"] is False
    assert release["selection_split"] is None
    # no metric computed on the private test split is in release/: not the best, not the evaluations
    published = "".join(p.read_text() for p in (tmp_path / "release").rglob("*") if p.is_file())
    for key in ("best_metric", "best_step", '"evals"', "eval_accuracy"):
        assert key not in published, key
    # ... they are the owner's, labelled, in diagnostics/
    assert NOT_DP_LABEL in diag["privacy"] and diag["private_evaluation"]["evals"]
    assert diag["private_evaluation"]["best_metric"] is not None
    # the card: the final parameters, why, and that the evaluation data was private
    assert card["checkpoint"] == {"rule": "final", "step": release["steps"]}
    assert card["evaluation_data"] == "private" and not card["evaluation"]
    assert "not declared public" in card["guarantee"]["selection"]
    assert "not declared public" in (tmp_path / "model" / deliverable.CARD_MD).read_text()


def test_cli_best_checkpoint_on_a_private_test_split_is_refused(tmp_path):
    out = tmp_path / "sub" / "r.json"
    line = one_error_line(["train", *OWN_FACTORIES, *OWN, "--checkpoint", "best", "--no-progress", "--out", str(out)])
    assert "--eval-public" in line and "--checkpoint final" in line
    assert not (tmp_path / "sub").exists()  # refused before any work


def test_cli_eval_public_allows_the_best_checkpoint(tmp_path):
    release, _, card = _own_run(tmp_path, "--eval-public", "--checkpoint", "best")
    assert release["checkpoint"] == "best" and release["eval_public"] is True
    assert release["selection_split"] == "test" and release["evals"]
    assert card["checkpoint"] == {"rule": "best", "step": release["best_step"]}
    assert card["evaluation_data"] == "declared public" and card["evaluation"]["best"] == release["best_metric"]
    # and --eval-public alone makes best the default
    again, _, _ = _own_run(tmp_path / "b", "--eval-public")
    assert again["checkpoint"] == "best"


def test_cli_builtin_dataset_test_split_stays_public_and_best(tmp_path):
    out = tmp_path / "r.json"
    res = invoke_train(out)
    assert res.exit_code == 0, res.output
    release = json.loads(out.read_text())
    assert release["checkpoint"] == "best" and release["eval_public"] is True and "best_metric" in release


def _tiny(n: int = 120):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n + 40, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(1)
    return (x[:n], y[:n]), (x[n:], y[n:])


KW = dict(steps=6, expected_batch_size=30, noise_multiplier=1.0, delta=1e-5, lr=0.5, clip=1.0, eval_every=2)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3))


def test_python_train_private_eval_data_gives_the_final_iterate(tmp_path):
    train, test = _tiny()
    res = dptune.train(_net(), train, "dpsgd", eval_data=test, **KW)
    assert res.checkpoint == "final" and res.best_params is None and res.evals
    for k, v in res.final_params.items():  # the model is the final iterate
        assert torch.equal(res.model_with("best").state_dict()[k], v)
    deliverable.save_trained(res, tmp_path / "m")
    card = json.loads((tmp_path / "m" / deliverable.CARD_JSON).read_text())
    assert card["checkpoint"]["rule"] == "final" and card["evaluation_data"] == "private"
    with pytest.raises(ConfigError, match=r"eval_public=True .*checkpoint='final'"):
        dptune.train(_net(), train, "dpsgd", eval_data=test, checkpoint="best", **KW)
    public = dptune.train(_net(), train, "dpsgd", eval_data=test, eval_public=True, **KW)
    assert public.checkpoint == "best" and public.best_params is not None
    final = dptune.train(_net(), train, "dpsgd", eval_data=test, eval_public=True, checkpoint="final", **KW)
    assert final.checkpoint == "final" and final.eval_public


def test_delta_at_least_one_over_n_is_refused_by_train_and_make_private():
    train, _ = _tiny(100)  # 1/n = 0.01
    kw = {**KW, "delta": 0.01, "noise_multiplier": None, "target_epsilon": 2.0}
    with pytest.raises(ConfigError, match=r"δ = 0.01 ≥ 1/n = 1/100.*allow_large_delta=True"):
        dptune.train(_net(), train, "dpsgd", **kw)
    assert dptune.train(_net(), train, "dpsgd", allow_large_delta=True, **kw).plan.steps == 6
    assert dptune.train(_net(), train, "dpsgd", **{**kw, "delta": 0.009}).plan.steps == 6  # below 1/n
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mp = dict(steps=3, expected_batch_size=20, target_epsilon=2.0, delta=0.05)
    with pytest.raises(ConfigError, match="1/n"):
        dptune.make_private(net, train, opt, **mp)
    assert dptune.make_private(net, train, opt, allow_large_delta=True, **mp).plan.steps == 3


def test_delta_at_least_one_over_n_is_refused_by_the_cli(tmp_path):
    out = tmp_path / "r.json"
    line = one_error_line(["train", *OWN_FACTORIES, *OWN, "--delta", "0.01", "--no-progress", "--out", str(out)])
    assert "1/n = 1/240" in line and "--allow-large-delta" in line
    res = invoke_train(out, "--delta", "0.01", "--allow-large-delta", data=OWN_FACTORIES, epochs="1", batch_size="40")
    assert res.exit_code == 0, res.output


def _study_toml(tmp_path: Path, data: str = "", selection: str = 'mode = "private"') -> Path:
    text = own_factories_study_toml("pbd").replace("n_test = 60 }", "n_test = 60 }\n" + data)
    p = tmp_path / "s.toml"
    p.write_text(text.replace('mode = "private"', selection))
    return p


def test_delta_at_least_one_over_n_is_refused_by_a_study(tmp_path):
    # n = 160 training examples: δ = 0.01 ≥ 1/160
    with pytest.raises(ConfigError, match=r"budget.delta.*1/n = 1/160.*budget.allow_large_delta = true"):
        plan_only(load_study_config(_big_delta(tmp_path)))
    allowed = load_study_config(_big_delta(tmp_path, "allow_large_delta = true"))
    assert plan_only(allowed).runs


def _big_delta(tmp_path: Path, extra: str = "") -> Path:
    p = tmp_path / "big.toml"
    p.write_text(own_factories_study_toml("pbd").replace("delta = 1e-5", "delta = 0.01\n" + extra))
    return p


def test_a_study_on_your_own_data_keeps_its_test_split_private(tmp_path):
    # public selection on the user's test split must be declared ...
    with pytest.raises(ConfigError, match=r"selection.mode.*data.test_public = true"):
        load_study_config(_study_toml(tmp_path, selection='mode = "public"'))
    declared = load_study_config(_study_toml(tmp_path, data="test_public = true", selection='mode = "public"'))
    assert declared.data.test_public
    # ... and a private one publishes no exact metric on it (the selection is noisy and charged)
    study = load_study_config(_study_toml(tmp_path))
    assert not study.data.test_public
    run_study(study, tmp_path / "s", progress=False)
    with Store(tmp_path / "s") as s:
        runs = list(s.runs())
    assert runs and all(r["status"] == "done" and r["test_metric"] is None for r in runs)
