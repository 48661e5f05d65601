"""Issue 11, item 4: the deliverable — the selected model's weights and card, and loading them.

A study saves each arm's selected checkpoint without retraining (the weights equal the selected
run's parameters bit for bit on CPU, and the ledger gains no release); ``dptune train --save``
and ``dptune export`` write model.pt + model_card.json/.md; ``dptune.load_model`` reloads it.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
import torch
from cli_helpers import OWN_FACTORIES, invoke_train
from tune_helpers import linear_data, make_study, tiny_dpsgd_study
from typer.testing import CliRunner

import dptune
from dptune import deliverable
from dptune.cli import app
from dptune.errors import ConfigError
from dptune.release.ledger import Ledger
from dptune.strategies import make_strategy
from dptune.train import RunPlan
from dptune.tune import SelectionSpec, run_study
from dptune.tune.data import build_model, study_data
from dptune.tune.export import export_study, study_ledger_digest
from dptune.tune.records import StudyPlan
from dptune.tune.results import study_table
from dptune.tune.store import Store


def _study(name: str = "deliver", trials_per_group: int = 1, seeds: tuple[int, ...] = (0,), **sel):
    # data seed and learning rates chosen so that the selected run's best checkpoint (step 8) is
    # not its final one (step 12): saving the final parameters would fail the bit-for-bit test
    return tiny_dpsgd_study(
        data_seed=4,
        n=260,
        dim=6,
        n_train=200,
        lrs=[0.05, 2.0],
        steps=12,
        batch=40,
        eps=1.0,
        selection=SelectionSpec(eval_every=4, **sel),
        seeds=seeds,
        name=name,
        trials_per_group=trials_per_group,
    )


def _ledger_rows(d: Path) -> list[tuple]:
    con = sqlite3.connect(f"file:{d / 'study.sqlite'}?mode=ro", uri=True)
    try:
        return list(con.execute("SELECT run_id, label, event, count, components FROM ledger ORDER BY id"))
    finally:
        con.close()


def _only_model_dir(d: Path) -> Path:
    (m,) = list((d / "release" / "models").iterdir())
    return m


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[object, Path]:
    study = _study()
    d = tmp_path_factory.mktemp("study")
    run_study(study, d, progress=False)
    return study, d


# ----------------------------------------------------------------------------- study: bit for bit, no release
def test_study_weights_equal_the_selected_run_retrained_with_its_seed(finished) -> None:
    """Independent reference: ``dptune.train`` of the selected run (same model seed, plan and
    run seed, best checkpoint on the selection split every eval_every steps) — bit for bit."""
    study, d = finished
    with Store(d, readonly=True) as store:
        plan = StudyPlan.from_dict(store.get_meta("plan"))
    (row,) = study_table(d)
    (rid,) = row["selected_runs"]
    run = plan.runs[rid]
    stored = dict(Store(d, readonly=True).run(rid))
    data = study_data(study.data, study.selection, study.seed)
    model = build_model(study.model, data, run.seed)
    strategy = make_strategy("dpsgd", **json.loads(stored["config"]))
    plan_ = RunPlan(strategy, data.n_train, run.sampling_rate, run.steps, run.noise_multiplier)
    ref = dptune.train(
        model,
        (data.x_train, data.y_train),
        strategy,
        plan=plan_,
        seed=run.run_seed,
        device="cpu",
        eval_data=(data.x_val, data.y_val),
        eval_public=True,  # the study selected in public mode
        eval_every=study.selection.eval_every,
    )
    assert ref.best_step == stored["best_step"] < run.steps  # a checkpoint before the end
    loaded, card = dptune.load_model(_only_model_dir(d))
    state = loaded.state_dict()
    assert set(state) == set(ref.best_params)
    for k, v in ref.best_params.items():
        assert torch.equal(state[k], v), k  # bit for bit
    # and they are the selected checkpoint, not the final parameters (this run improves late or not)
    assert card["checkpoint"]["step"] == ref.best_step
    assert card["configuration"]["hyperparameters"] == json.loads(stored["config"])


def test_vectorized_group_saves_each_trials_own_selected_parameters(tmp_path: Path, monkeypatch) -> None:
    """train_many groups: the saved weights are the parameters the scorer selected for that
    trial (captured by a spy on the worker), for the selected run."""
    from dptune.tune import worker

    seen: dict[str, dict[str, torch.Tensor]] = {}
    original = worker._RunJob.finish

    def spy(self, result, seconds=None):
        if result.best_params is not None:
            seen[self.run.run_id] = {k: v.detach().clone() for k, v in result.best_params.items()}
        return original(self, result, seconds)

    monkeypatch.setattr(worker._RunJob, "finish", spy)
    run_study(_study("grouped", trials_per_group=4), tmp_path, progress=False)
    (row,) = study_table(tmp_path)
    (rid,) = row["selected_runs"]
    assert len(seen) == 2  # both trials of the group were scored
    loaded, _ = dptune.load_model(_only_model_dir(tmp_path))
    for k, v in seen[rid].items():
        assert torch.equal(loaded.state_dict()[k], v), k
    other = next(r for r in seen if r != rid)
    assert any(not torch.equal(loaded.state_dict()[k], v) for k, v in seen[other].items())


def test_saving_and_exporting_release_nothing(finished) -> None:
    study, d = finished
    before = _ledger_rows(d)
    digest = study_ledger_digest(d)
    res = CliRunner().invoke(app, ["export", str(d), "--arm", "dpsgd@eps=1"])
    assert res.exit_code == 0, res.output
    export_study(d)
    assert _ledger_rows(d) == before
    assert study_ledger_digest(d) == digest
    with Store(d, readonly=True) as store:
        plan = StudyPlan.from_dict(store.get_meta("plan"))
        led = Ledger()
        for e in store.ledger_entries():
            led.record(e.event, e.label, count=e.count, components=e.components, run=e.run)
    assert led.matches(plan.release_event)  # exactly the plan: no extra release


def test_card_states_the_guarantee_and_the_ledger_digest(finished) -> None:
    study, d = finished
    m = _only_model_dir(d)
    card = json.loads((m / deliverable.CARD_JSON).read_text())
    (row,) = study_table(d)
    g = card["guarantee"]
    assert g["epsilon"] == row["planned_epsilon"] and g["delta"] == 1e-5 and g["accountant"] == "rdp"
    assert "public" in g["selection"] and g["covered"] and g["not_covered"]
    # the digest is the ledger's, recomputed here from the stored rows (canonical multiset)
    rows = sorted(
        json.dumps(
            {"label": lab, "event": json.loads(ev), "count": c, "components": json.loads(comp), "run": r},
            sort_keys=True,
            separators=(",", ":"),
        )
        for r, lab, ev, c, comp in _ledger_rows(d)
    )
    assert card["ledger"]["digest"] == hashlib.sha256(("[" + ",".join(rows) + "]").encode()).hexdigest()
    assert card["weights"]["sha256"] == deliverable.file_sha256(m / deliverable.WEIGHTS_FILE)
    assert card["randomness"] == "seeded" and card["model"]["name"] == "logistic_regression"
    assert card["dptune_version"] == dptune.__version__
    # no hash of the private training tensors, no absolute path in a published file
    assert study.data.fingerprint() not in json.dumps(card)
    text = (m / deliverable.CARD_MD).read_text()
    assert str(d) not in text and card["ledger"]["digest"] in text and "Not covered" in text


def test_only_selected_checkpoints_are_kept_and_they_stay_owner_only(finished) -> None:
    _, d = finished
    files = list((d / deliverable.CHECKPOINTS_DIR).glob("*.pt"))
    (row,) = study_table(d)
    assert [f.name for f in files] == [deliverable.checkpoint_path(d, row["selected_runs"][0]).name]
    assert (d / deliverable.CHECKPOINTS_DIR).stat().st_mode & 0o077 == 0
    assert not list((d / "release").rglob("*.pt.tmp*"))
    assert [p.name for p in (d / "release" / "models").iterdir()] == ["dpsgd@eps=1"]  # one model per arm


def test_ledger_digest_is_order_free_and_changes_with_any_entry() -> None:
    from dp_accounting import dp_event

    a, b = Ledger(), Ledger()
    a.record(dp_event.GaussianDpEvent(2.0), "x", run="r1")
    a.record(dp_event.GaussianDpEvent(3.0), "y", run="r2")
    b.record(dp_event.GaussianDpEvent(3.0), "y", run="r2")
    b.record(dp_event.GaussianDpEvent(2.0), "x", run="r1")
    assert a.digest() == b.digest()
    b.record(dp_event.GaussianDpEvent(2.0), "x", run="r3")
    assert a.digest() != b.digest()


# ----------------------------------------------------------------------------- export errors
def test_export_bad_arm_is_one_clear_error_listing_the_arms(finished) -> None:
    _, d = finished
    res = CliRunner().invoke(app, ["export", str(d), "--arm", "nope"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "nope" in res.output and "dpsgd@eps=1" in res.output


def test_export_of_an_unfinished_study_is_refused(tmp_path: Path) -> None:
    run_study(_study("unfinished"), tmp_path, progress=False)
    con = sqlite3.connect(tmp_path / "study.sqlite")
    with con:
        con.execute("UPDATE runs SET status = 'planned' WHERE run_id = (SELECT run_id FROM runs LIMIT 1)")
    con.close()
    res = CliRunner().invoke(app, ["export", str(tmp_path)])
    assert res.exit_code == 2 and "not finished" in res.output and "resume" in res.output
    assert "runs done" not in res.output  # found in an audit: the run counts state Liu–Talwar's secret K
    with pytest.raises(ConfigError, match="not finished"):
        export_study(tmp_path)


# ----------------------------------------------------------------------------- crash safety
def test_atomic_write_never_leaves_half_a_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "m" / "model.pt"
    deliverable.save_state_dict({"w": torch.ones(3)}, path)
    good = path.read_bytes()

    def broken(obj, fh, *a, **k):
        fh.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError):
        deliverable.save_state_dict({"w": torch.zeros(3)}, path)
    assert path.read_bytes() == good  # the old file, intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]  # no temporary left over
    with pytest.raises(OSError):
        deliverable.save_checkpoint(tmp_path / "s", "arm/p0", {"state_dict": {"w": torch.ones(1)}})
    assert not list((tmp_path / "s" / deliverable.CHECKPOINTS_DIR).glob("*.pt*"))


def test_a_run_is_committed_only_after_its_checkpoint_is_on_disk(tmp_path: Path, monkeypatch) -> None:
    """A crash between the checkpoint and the commit: the run re-executes on resume (same seeds),
    and its checkpoint is the same bytes."""
    from dptune.tune import resume_study
    from dptune.tune.study import Coordinator

    study = _study("crash")
    original = Coordinator.merge
    state = {"n": 0}

    def crash_after_first_checkpoint(self, run_id, result):
        if state["n"] == 1:
            deliverable.save_checkpoint(self.store.dir, run_id, result["checkpoint"])
            raise KeyboardInterrupt  # killed before the commit
        state["n"] += 1
        return original(self, run_id, result)

    monkeypatch.setattr(Coordinator, "merge", crash_after_first_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        run_study(study, tmp_path, progress=False)
    ckpts = {p.name: p.read_bytes() for p in (tmp_path / deliverable.CHECKPOINTS_DIR).glob("*.pt")}
    assert len(ckpts) == 2
    monkeypatch.setattr(Coordinator, "merge", original)
    resume_study(tmp_path, study=study, progress=False)
    (row,) = study_table(tmp_path)
    kept = deliverable.checkpoint_path(tmp_path, row["selected_runs"][0])
    assert kept.read_bytes() == ckpts[kept.name]


# ----------------------------------------------------------------------------- dptune.train
def _tiny(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(240, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(1)
    return (x[:200], y[:200]), (x[200:], y[200:])


def test_save_trained_then_load_model_gives_identical_outputs(tmp_path: Path) -> None:
    from dptune import models

    train, test = _tiny()
    torch.manual_seed(1)
    net = models.build("logistic_regression", input_dim=5, classes=3)
    res = dptune.train(
        net,
        train,
        "dpsgd",
        steps=12,
        expected_batch_size=40,
        target_epsilon=2.0,
        delta=1e-5,
        eval_data=test,
        eval_public=True,
        eval_every=3,
        lr=0.5,
        clip=1.0,
        seed=4,
    )
    before = res.ledger.releases
    deliverable.save_trained(
        res, tmp_path / "m", model_id={"name": "logistic_regression", "kwargs": {"input_dim": 5, "classes": 3}}
    )
    assert res.ledger.releases == before
    loaded, card = dptune.load_model(tmp_path / "m")
    ref = res.model_with("best")
    with torch.no_grad():
        assert torch.equal(loaded(test[0]), ref(test[0]))
    assert card["checkpoint"] == {"rule": "best", "step": res.best_step}
    assert (
        card["guarantee"]["epsilon"] == pytest.approx(res.epsilon()) and card["ledger"]["digest"] == res.ledger.digest()
    )
    # a user module: pass model=; a wrong architecture is one clear error
    (tmp_path / "m" / deliverable.CARD_JSON).write_text(json.dumps({**card, "model": {"class": "x.Net"}}))
    with pytest.raises(ConfigError, match="model="):
        dptune.load_model(tmp_path / "m")
    with pytest.raises(ConfigError, match="do not fit"):
        dptune.load_model(tmp_path / "m", model=torch.nn.Linear(2, 2))
    own, _ = dptune.load_model(
        tmp_path / "m" / "model.pt", model=models.build("logistic_regression", input_dim=5, classes=3)
    )
    assert torch.equal(own[1].weight, ref[1].weight)


def test_load_model_refuses_tampered_weights(tmp_path: Path) -> None:
    train, test = _tiny()
    net = torch.nn.Sequential(torch.nn.Linear(5, 3))
    res = dptune.train(net, train, "dpsgd", steps=3, expected_batch_size=40, noise_multiplier=1.0, lr=0.1, clip=1.0)
    deliverable.save_trained(res, tmp_path)
    deliverable.save_state_dict({"0.weight": torch.zeros(3, 5), "0.bias": torch.zeros(3)}, tmp_path / "model.pt")
    with pytest.raises(ConfigError, match="SHA-256"):
        dptune.load_model(tmp_path, model=torch.nn.Sequential(torch.nn.Linear(5, 3)))


def test_train_cli_save_writes_model_and_card_that_load_back(tmp_path: Path) -> None:
    out, save = tmp_path / "run.json", tmp_path / "model"
    res = invoke_train(out, "--save", str(save))
    assert res.exit_code == 0, (res.output, res.exception)
    assert {p.name for p in save.iterdir()} == {"model.pt", "model_card.json", "model_card.md"}
    rel = json.loads(out.read_text())
    model, card = dptune.load_model(save)
    assert card["guarantee"]["epsilon"] == pytest.approx(rel["epsilon"])
    assert card["checkpoint"]["step"] == rel["best_step"] and card["data"] == {"name": "digits"}
    assert len(card["ledger"]["digest"]) == 64
    from dptune.data import load

    ds = load("digits")
    with torch.no_grad():
        acc = (model(ds.x_test).argmax(1) == ds.y_test).float().mean().item()
    assert acc == pytest.approx(rel["best_metric"])  # the saved weights are the best checkpoint's


def test_hidden_k_study_withholds_the_digest_from_published_cards(tmp_path: Path) -> None:
    """With a Liu–Talwar arm the ledger is a function of K (secret): hashing guesses of K would
    find it, so the published cards carry no digest; the owner's copy is in diagnostics/."""
    from dptune.outputs import NOT_DP_LABEL
    from dptune.tune import MethodSpec, StrategyArm, TrainingSpec

    study = make_study(
        linear_data(5, n=140, dim=5, n_train=100),
        arms=(
            StrategyArm(
                "dpsgd",
                space={"lr": [0.05, 1.0]},
                fixed={"clip": 1.0},
                label="lt",
                method=MethodSpec("liu-talwar", {"gamma": 0.5}),
            ),
        ),
        training=TrainingSpec(steps=4, expected_batch_size=20),
        eps=4.0,
        selection=SelectionSpec(eval_every=2),
        name="lt-card",
    )
    run_study(study, tmp_path, progress=False)
    m = _only_model_dir(tmp_path)
    card = json.loads((m / deliverable.CARD_JSON).read_text())
    digest = study_ledger_digest(tmp_path)
    assert card["ledger"]["digest"] is None and "withheld" in card["ledger"]["note"]
    assert digest not in (m / deliverable.CARD_JSON).read_text() + (m / deliverable.CARD_MD).read_text()
    diag = json.loads((tmp_path / "diagnostics" / "models" / m.name / "ledger_digest.json").read_text())
    assert diag["digest"] == digest and NOT_DP_LABEL in diag["privacy"].lower()
    assert card["guarantee"]["kind"] == "liu-talwar"
    res = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output  # found in an audit: its owner-only digest came without the folder's label
    assert (tmp_path / "o" / "diagnostics" / "models" / m.name / "ledger_digest.json").is_file()
    assert NOT_DP_LABEL in (tmp_path / "o" / "diagnostics" / "README.txt").read_text().lower()


def test_an_unfinished_hidden_k_search_releases_no_selection(tmp_path: Path) -> None:
    """Liu–Talwar covers the best of the WHOLE secret search: while a run is not done, nothing selected
    (configuration, score, test metric) reaches the table that release/ is written from, and the
    report's plan table shows no run's T or ν (the first run is a secret draw). Found in review."""
    import sqlite3

    from dptune.report.summary import tried_section
    from dptune.tune import MethodSpec, StrategyArm, TrainingSpec
    from dptune.tune.results import load_study

    study = make_study(
        linear_data(5, n=140, dim=5, n_train=100),
        arms=(StrategyArm("dpsgd", space={"lr": [0.05, 1.0]}, fixed={"clip": 1.0}, label="lt",
                          method=MethodSpec("liu-talwar", {"gamma": 0.5})),),
        training=TrainingSpec(steps=4, expected_batch_size=20), eps=4.0, selection=SelectionSpec(eval_every=2),
        name="lt-unfinished",
    )  # fmt: skip
    run_study(study, tmp_path, progress=False)
    (done,) = study_table(tmp_path)
    assert done["selected"] and done["value_mean"] is not None
    cfg, plan, rows, _ = load_study(tmp_path)
    (table,) = tried_section(cfg, plan).tables
    assert table.rows[0][-2:] == ["per candidate", "per candidate"]
    with sqlite3.connect(tmp_path / "study.sqlite") as con:  # one run back to planned: an interrupted study
        con.execute("UPDATE runs SET status = 'planned' WHERE run_id = ?", (rows[0]["run_id"],))
    (row,) = study_table(tmp_path)
    assert row["selected"] == "" and row["value_mean"] is None and row["test_mean"] is None
    assert row["selected_runs"] == []


def test_the_ledger_digest_leaves_out_non_private_arms(tmp_path: Path) -> None:
    """A nodp arm's entries record when its noiseless run diverged (a function of the data): the digest
    on the private arms' cards covers their entries only, so it does not move with the baseline."""
    from dptune.tune import StrategyArm, TrainingSpec

    digests = []
    for lr in (0.1, 3e38):  # the second baseline diverges at step 4 of 12
        study = make_study(
            linear_data(5, n=140, dim=5, n_train=100),
            arms=(StrategyArm("dpsgd", space={"lr": [0.5]}, fixed={"clip": 1.0}, label="dp"),
                  StrategyArm("nodp", space={"lr": [lr]}, label="base")),
            training=TrainingSpec(steps=12, expected_batch_size=20), eps=4.0, selection=SelectionSpec(eval_every=2),
            name=f"digest-{int(lr > 1)}",
        )  # fmt: skip
        d = tmp_path / str(lr)
        run_study(study, d, progress=False)
        digests.append(study_ledger_digest(d))
    assert digests[0] == digests[1]


def test_train_cli_save_with_your_own_factory_reloads_without_model_argument(tmp_path: Path) -> None:
    """--model pkg.module:factory: the card names the factory and the arguments it was given,
    so ``load_model(DIR)`` rebuilds it; the weights are the best checkpoint's."""
    from own_factories import load_data

    out, save = tmp_path / "run.json", tmp_path / "model"
    res = invoke_train(
        out, "--save", str(save), "--eval-public", data=OWN_FACTORIES, epochs="1", batch_size="40", hps=["lr=0.5"]
    )
    assert res.exit_code == 0, res.output
    with pytest.raises(ConfigError, match="trust_factory"):  # the card names code: never run unasked
        dptune.load_model(save)
    model, card = dptune.load_model(save, trust_factory=True)
    # what the CLI gave the factory (a map-style dataset's classes are not known: the default)
    assert card["model"] == {"factory": "own_factories:make_model", "kwargs": {"input_dim": 6}}
    _, test = load_data()
    x = torch.stack([test[i][0] for i in range(len(test))])
    y = torch.stack([test[i][1] for i in range(len(test))])
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).double().mean().item()
    assert acc == pytest.approx(json.loads(out.read_text())["best_metric"])


def test_final_checkpoint_rule_saves_the_final_parameters(tmp_path: Path) -> None:
    study = _study("final", checkpoint="final")
    run_study(study, tmp_path, progress=False)
    with Store(tmp_path, readonly=True) as store:
        plan = StudyPlan.from_dict(store.get_meta("plan"))
        (row,) = study_table(tmp_path)
        (rid,) = row["selected_runs"]
        stored = dict(store.run(rid))
    run = plan.runs[rid]
    data = study_data(study.data, study.selection, study.seed)
    strategy = make_strategy("dpsgd", **json.loads(stored["config"]))
    ref = dptune.train(
        build_model(study.model, data, run.seed),
        (data.x_train, data.y_train),
        strategy,
        plan=RunPlan(strategy, data.n_train, run.sampling_rate, run.steps, run.noise_multiplier),
        seed=run.run_seed,
        device="cpu",
    )
    loaded, card = dptune.load_model(_only_model_dir(tmp_path))
    assert card["checkpoint"] == {"rule": "final", "step": run.steps}
    for k, v in ref.final_params.items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_report_writes_the_models_into_its_output_folder(finished, tmp_path: Path) -> None:
    _, d = finished
    res = CliRunner().invoke(app, ["report", str(d), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    m = tmp_path / "release" / "models" / "dpsgd@eps=1"
    assert (m / "model.pt").read_bytes() == (_only_model_dir(d) / "model.pt").read_bytes()
    for again in (["report", str(d), "--out", str(tmp_path)], ["export", str(d), "--out", str(tmp_path)]):
        assert CliRunner().invoke(app, again).exit_code == 0  # its own earlier output: written again


def test_report_and_export_refuse_another_studys_folder_as_out(finished, tmp_path: Path) -> None:
    """Found in an audit: `report s1 --out <s2's folder>` replaced s2's published model with s1's, its release's
    guarantee line then false. A folder holding anything but this study's earlier report or export is refused."""
    _, d = finished
    study2, report2 = tmp_path / "s2", tmp_path / "r2"  # another study, and another study's report
    (study2 / "study.sqlite").parent.mkdir()
    (study2 / "study.sqlite").write_bytes(b"")
    (report2 / ".dptune-study").parent.mkdir()
    (report2 / ".dptune-study").write_text(f"{study2.resolve()}\n")
    for other in (study2, report2):
        (m := other / "release" / "models" / "dpsgd@eps=1").mkdir(parents=True)
        (m / "model.pt").write_bytes(b"the other study's model")
        for cmd in ("report", "export"):
            res = CliRunner().invoke(app, [cmd, str(d), "--out", str(other)])
            assert res.exit_code == 2 and "is not empty" in res.output and "Fix:" in res.output, res.output
        assert (m / "model.pt").read_bytes() == b"the other study's model"
        assert {p.name for p in other.iterdir()} == {"release", "study.sqlite" if other == study2 else ".dptune-study"}
    assert CliRunner().invoke(app, ["export", str(d), "--out", str(d)]).exit_code == 0  # the study's own folder


def test_a_secure_train_card_states_the_float_slack_and_loads_from_the_given_path(tmp_path: Path, monkeypatch) -> None:
    """Found in an audit: a secure card's note said "epsilon_float_slack: stated here", but only the release JSON
    stated it; and `--save t1/model` wrote `load_model('model')`, which fails where the user is."""
    monkeypatch.chdir(tmp_path)
    res = invoke_train(Path("run.json"), "--secure", "--save", "t1/model")
    assert res.exit_code == 0, (res.output, res.exception)
    slack = json.loads(Path("run.json").read_text())["epsilon_float_slack"]
    card = json.loads(Path("t1/model", deliverable.CARD_JSON).read_text())
    assert card["guarantee"]["epsilon_float_slack"] == slack > 0 and "slack" in res.output  # the terminal's table
    assert "epsilon_float_slack: " in Path("t1/model", deliverable.CARD_MD).read_text()
    namespace: dict = {}
    exec(card["load"], namespace)  # the card's own code, run where the user trained
    assert namespace["card"]["weights"] == card["weights"]


@pytest.mark.parametrize("save", ["../alice_home/secret_project/model", "ABS"])
def test_a_cards_load_path_never_names_folders_outside_the_working_one(tmp_path: Path, monkeypatch, save: str) -> None:
    """Found in review: `--save ../alice_home/secret_project/model` published that path in the card's load code.
    A relative path climbing out of the working folder, or an absolute one, is written as the folder's name."""
    (work := tmp_path / "work").mkdir()
    monkeypatch.chdir(work)
    save = str(tmp_path / "alice_home" / "secret_project" / "model") if save == "ABS" else save
    assert invoke_train(Path("run.json"), "--save", save).exit_code == 0
    card = json.loads(Path(save, deliverable.CARD_JSON).read_text())
    assert "load_model('model')" in card["load"], card["load"]
    assert "alice_home" not in Path(save, deliverable.CARD_MD).read_text()


def test_a_non_private_arm_is_never_published(tmp_path: Path) -> None:
    """The nodp baseline's weights are covered by no guarantee: they go to diagnostics/models/
    with the label, never to release/ (the demo has such an arm)."""
    from dptune.outputs import NOT_DP_LABEL
    from dptune.tune import StrategyArm, TrainingSpec

    study = make_study(
        linear_data(6, n=140, dim=5, n_train=100),
        arms=(
            StrategyArm("dpsgd", space={"lr": [0.5]}, fixed={"clip": 1.0}),
            StrategyArm("nodp", space={"lr": [0.5]}),
        ),
        training=TrainingSpec(steps=4, expected_batch_size=20),
        eps=4.0,
        selection=SelectionSpec(eval_every=2),
        name="with-nodp",
    )
    run_study(study, tmp_path, progress=False)
    published = sorted(p.name for p in (tmp_path / "release" / "models").iterdir())
    assert published and not any("nodp" in name for name in published)
    owner = [p for p in (tmp_path / "diagnostics" / "models").iterdir() if "nodp" in p.name]
    assert len(owner) == 1
    card = json.loads((owner[0] / deliverable.CARD_JSON).read_text())
    assert NOT_DP_LABEL in card["privacy"].lower()
    assert NOT_DP_LABEL in (owner[0] / deliverable.CARD_MD).read_text().lower()


def test_a_cards_stated_epsilon_and_delta_are_rounded_up() -> None:
    """Found in review (session 13): the card's guarantee line rounded ε to nearest, 2.99969 for a ledger's
    2.9996931, below it and below the terminal's 2.9997; 7 of the demo's 8 cards understated ε."""
    import re

    from dptune.deliverable import card_markdown

    for eps, delta in [(2.9996930794666845, 1e-5), (7.999353291261645, 3.0000000001e-5), (8.0, 1e-6)]:
        text = card_markdown({"guarantee": {"epsilon": eps, "delta": delta, "accountant": "pld"}})
        stated = re.search(r"\(([0-9.e+-]+), ([0-9.e+-]+)\)-differential privacy", text)
        assert stated is not None, text
        assert float(stated[1]) >= eps and float(stated[2]) >= delta, stated[0]
        assert float(stated[1]) <= eps * (1 + 1e-5)  # still the number, six digits
