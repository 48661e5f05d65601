"""Tuning methods are plug-ins (issue 14): a method defined here, registered, plans, runs and reports
through the unchanged tuner; every method's options are checked with a clear error; the aliases
resolve; and the built-in methods plan exactly what they planned before they became plug-ins."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from conftest import TESTS
from tune_helpers import make_study, tiny_dpsgd_study

from dptune import accounting
from dptune.errors import ConfigError, config_error
from dptune.tune import (
    MethodSpec,
    SelectionSpec,
    StrategyArm,
    Study,
    TrainingSpec,
    methods,
    plan_study,
    theory,
)
from dptune.tune import space as S
from dptune.tune.builder import Builder, guarantee_scope, make_arm_id
from dptune.tune.methods import TuningMethod, canonical_method, get_method
from dptune.tune.records import ArmPlan, StudyPlan, calibrate_nu, choose_accountant
from dptune.tune.results import budget_rows, study_table
from dptune.tune.shapes import make_shape, snap
from dptune.tune.study import run_study

REFERENCE = TESTS / "data" / "method_plans.json"
BUILT_IN = ("grid", "random", "online", "oracle", "liu-talwar", "repeat-and-select", "linear-scaling")


# ----------------------------------------------------------------------------- a plug-in
@dataclasses.dataclass(frozen=True)
class FirstOnlyOptions:
    index: int = 0  # which configuration of the grid is run

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise config_error("method.index", f"must be an integer ≥ 0, got {self.index!r}", "e.g. index = 0")


class FirstOnly(TuningMethod):
    """Runs one configuration of the grid (the ``index``-th) at the whole ε: one run per seed
    replicate, each replicate its own procedure (``across_seeds = "per-seed"``, seeds unaccounted)."""

    name = "first-only"
    aliases = ("first",)
    Options = FirstOnlyOptions
    needs_value_lists = True

    def plan(self, b: Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
        study, ctx = b.ctx.study, b.ctx
        config = S.grid(arm.space)[study.method_for(arm).options["index"]]
        shape = make_shape(ctx, arm, config, f"{path}.space")
        arm_id, delta = make_arm_id(arm.key, eps), study.budget.delta
        acc = choose_accountant(study.budget.accountant, shape.event(1.0))
        nu = snap(calibrate_nu(shape.event, eps, delta, acc, arm_id), [shape])
        run_ids = [
            r for p in range(len(study.seeds)) for r in b.add_candidate(arm, arm_id, "main", 0, p, config, shape, nu)
        ]
        eps_run = accounting.epsilon(shape.event(nu), delta, acc)
        guarantee = {
            "kind": "composition",
            "epsilon": eps_run,
            "delta": delta,
            "per": guarantee_scope(study),
            "accountant": acc,
        }
        return self.arm_plan(b, arm, eps, accountant=acc, guarantee=guarantee, runs=run_ids)


@pytest.fixture
def first_only():
    methods.register(FirstOnly)
    try:
        yield FirstOnly
    finally:
        methods.unregister("first-only")
    assert "first-only" not in methods.names()


def _plug_in_study(method: MethodSpec) -> Study:
    study = tiny_dpsgd_study(
        data_seed=3,
        n=120,
        dim=4,
        n_train=80,
        lrs=[0.5, 2.0],
        steps=6,
        batch=20,
        eps=2.0,
        selection=SelectionSpec(eval_every=3),
        seeds=(0, 1),
        name="first-only",
    )
    return dataclasses.replace(study, method=method)


def test_a_method_defined_outside_dptune_plans_runs_and_reports(first_only, tmp_path):
    assert tuple(methods.names()) == (*BUILT_IN, "first-only")
    study = _plug_in_study(MethodSpec("FIRST", {"index": 1}))  # an alias, any case
    assert study.method.name == "first-only" and study.method.options == {"index": 1}

    plan = plan_study(study, 80, 40, "accuracy")
    (arm,) = plan.arms
    assert arm.method == "first-only" and len(arm.runs) == 2  # one run per seed
    assert all(plan.runs[r].config == {"clip": 1.0, "lr": 2.0} for r in arm.runs)  # grid[1]
    assert arm.guarantee["epsilon"] <= 2.0

    out = run_study(study, tmp_path / "s", progress=False)
    assert out.complete and out.ledger_matches_plan
    (row,) = study_table(tmp_path / "s")
    assert row["method"] == "first-only" and row["runs_total"] == row["runs_done"] == 2
    assert row["selected"].startswith("clip=1, lr=2") and row["replicates"] == 2
    assert row["spent_epsilon"] == pytest.approx(arm.guarantee["epsilon"])  # composition: the default spent()
    assert row["guarantee_per"] == "seed replicate"
    per_run, per_label = budget_rows(tmp_path / "s")
    assert len(per_run) == 2 and not any(r["label"].startswith("(every run") for r in per_label)


def test_a_plug_ins_options_and_name_are_checked_like_the_built_ins(first_only):
    with pytest.raises(ConfigError, match=r"^method\.index: must be an integer ≥ 0, got -1\. Fix: e\.g\. index = 0$"):
        MethodSpec("first-only", {"index": -1})
    with pytest.raises(ConfigError, match=r"^method\.n: method 'first-only' has no option 'n'\. Fix: .*index$"):
        MethodSpec("first-only", {"n": 3})
    continuous = (StrategyArm("dpsgd", space={"lr": {"log_uniform": [0.1, 1.0]}}),)
    with pytest.raises(ConfigError, match=r"^strategies\[0\]\.space\.lr: method 'first-only' needs a list of values"):
        dataclasses.replace(_plug_in_study(MethodSpec("first-only")), strategies=continuous)
    with pytest.raises(ConfigError, match="already registered. Fix:"):
        methods.register(FirstOnly)

    class Clash(FirstOnly):
        name = "first-again"
        aliases = ("lt",)  # Liu–Talwar's

    with pytest.raises(ConfigError, match="'lt' is already registered. Fix:"):
        methods.register(Clash)
    Clash.aliases = ("First Again",)  # never matched: names are looked up lower-cased
    with pytest.raises(ConfigError, match="lower-case strings, got 'First Again'. Fix:"):
        methods.register(Clash)
    assert "first-again" not in methods.names()


def test_an_unregistered_method_is_an_unknown_name():
    with pytest.raises(
        ConfigError, match=r"^method\.name: unknown tuning method 'first-only'\. Fix: choose one of grid, "
    ):
        MethodSpec("first-only")


# ----------------------------------------------------------------------------- options and names
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_method_rejects_an_unknown_option_naming_it(name):
    allowed = [f.name for f in dataclasses.fields(get_method(name).Options)]
    with pytest.raises(ConfigError) as exc:
        MethodSpec(name, {"no_such_option": 1})
    assert str(exc.value) == (
        f"method.no_such_option: method {name!r} has no option 'no_such_option'. "
        f"Fix: its options are: {', '.join(allowed) or '(none)'}"
    )


@pytest.mark.parametrize(
    ("name", "option"),
    [(m, f.name) for m in BUILT_IN for f in dataclasses.fields(get_method(m).Options)],
)
def test_every_option_rejects_a_bad_value_naming_it(name, option):
    """A value of no sensible type (an ``object()``) for each option of each method."""
    with pytest.raises(ConfigError) as exc:
        MethodSpec(name, {option: object()})
    assert str(exc.value).startswith(f"method.{option}: ") and ". Fix: " in str(exc.value)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        (
            "random",
            {"n": 0},
            "method.n: must be an integer ≥ 1, got 0. Fix: e.g. n = 10 (n = 1: Panda's random search)",
        ),
        ("liu-talwar", {"delta2_fraction": 1}, "method.delta2_fraction: must lie in (0, 1), got 1. Fix: "),
        ("repeat-and-select", {"shape": 0.5}, "method.shape: shape is only for distribution = 'negative-binomial'"),
        ("linear-scaling", {"fit": "quadratic"}, "method.fit: a quadratic fit needs ≥ 3 sweeps. Fix: "),
    ],
)
def test_options_keep_their_messages(name, options, message):
    with pytest.raises(ConfigError) as exc:
        MethodSpec(name, options)
    assert str(exc.value).startswith(message)


def test_options_are_completed_with_defaults_in_field_order():
    assert MethodSpec("lt", {"gamma": 0.2}).options == {"gamma": 0.2, "delta2_fraction": 0.5}
    assert list(MethodSpec("panda").options) == [
        "sweep_epsilons",
        "runs_per_sweep",
        "fit",
        "fit_axis",
        "r_sampling",
        "final_steps",
    ]
    assert MethodSpec("grid").options == {}


def test_every_alias_maps_to_its_method():
    legacy = {  # the alias table before the methods became plug-ins
        "lt": "liu-talwar",
        "liu_talwar": "liu-talwar",
        "liutalwar": "liu-talwar",
        "repeat_and_select": "repeat-and-select",
        "papernot-steinke": "repeat-and-select",
        "linear_scaling": "linear-scaling",
        "panda": "linear-scaling",
        "oso": "online",
        "ma": "grid",
    }
    declared = {alias: get_method(m).name for m in methods.names() for alias in get_method(m).aliases}
    assert declared == legacy
    for alias, name in legacy.items():
        assert canonical_method(alias) == name == canonical_method(f" {alias.upper()} ")
        assert get_method(alias) is get_method(name)
    for name in BUILT_IN:
        assert canonical_method(name) == name
    with pytest.raises(ConfigError, match=r"^strategies\[0\]\.method\.name: must be a string, got 3\. Fix: "):
        canonical_method(3, "strategies[0].method.name")


def test_the_methods_that_hide_the_number_of_runs_are_declared_to_the_outputs():
    """Whatever holds a study plan has imported the tuner, which registers the built-in methods:
    the release/diagnostics split then knows which guarantees keep K secret."""
    code = (
        "from dptune.tune.records import StudyPlan\n"
        "from dptune.outputs import hides_run_count\n"
        "print([hides_run_count(k) for k in ('liu-talwar', 'repeat-and-select', 'composition', 'nonprivate')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[True, True, False, False]"
    assert {m for m in methods.names() if get_method(m).hides_run_count} == {"liu-talwar", "repeat-and-select"}


def test_k_hiding_fails_closed_without_the_tuner_and_survives_unregister():
    """The built-in K-hiding kinds hold even in a process that never imported the tuner, and a
    built-in cannot be unregistered (then re-registered without hiding K)."""
    code = "from dptune.outputs import hides_run_count\nprint(hides_run_count('liu-talwar'), hides_run_count('repeat-and-select'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True True"
    for name in ("liu-talwar", "lt", "repeat-and-select", "grid"):
        with pytest.raises(ConfigError, match="built-in tuning method and cannot be unregistered. Fix:"):
            methods.unregister(name)
    assert get_method("lt").hides_run_count


class _HidesKWrongKind(FirstOnly):
    name = "hides-k"
    aliases = ()
    hides_run_count = True  # but its plan says kind "composition": K would reach the release


def test_a_method_that_hides_k_must_name_its_guarantee_kind(tmp_path):
    methods.register(_HidesKWrongKind)
    try:
        study = _plug_in_study(MethodSpec("hides-k", {"index": 0}))
        with pytest.raises(
            ConfigError, match="hides the number of runs, but its plan's guarantee kind is 'composition'"
        ):
            plan_study(study, 80, 40, "accuracy")
    finally:
        methods.unregister("hides-k")


# ----------------------------------------------------------------------------- plans as before
def _tensors():
    x = torch.zeros(8, 4)
    y = torch.tensor([0, 1] * 4)
    return (x, y, x, y)


def method_study(method: str) -> Study:
    """One tiny study per built-in method (tests/data/method_plans.json holds their plans as the
    planners wrote them before the methods became plug-ins, with ``SecretCoins(seed=7)``; random's
    second procedure since then draws its own configurations: only its two lr values changed)."""
    lrs = {"lr": [0.1, 1.0]}
    arms = (StrategyArm("dpsgd", space=lrs, fixed={"clip": 1.0}),)
    training = TrainingSpec(steps=20, expected_batch_size=50)
    opts: dict = {}
    accountant, seeds, across = "rdp", (0, 1), "per-seed"
    selection = None
    if method == "grid":
        arms += (StrategyArm("nodp", space=lrs),)
        selection = SelectionSpec(mode="private", split="holdout", eval_every=10, noise_multiplier=50.0)
    elif method == "random":
        arms = (StrategyArm("dpsgd", space={"lr": {"log_uniform": [0.01, 1.0]}}, fixed={"clip": 1.0}),)
        opts = {"n": 2}
    elif method == "online":
        arms = (StrategyArm("oso", space=lrs),)
    elif method == "liu-talwar":
        accountant, across = "auto", "mean"
    elif method == "repeat-and-select":
        opts = {"mean": 2, "distribution": "geometric"}
    elif method == "linear-scaling":
        space = {"lr": {"log_uniform": [0.01, 1.0]}, "steps": {"int_uniform": [5, 20]}}
        arms = (StrategyArm("dpgd", space=space),)
        training = TrainingSpec(steps=10, full_batch=True)
        opts, accountant = {"runs_per_sweep": 2}, "auto"
    return make_study(
        _tensors(),
        arms=arms,
        training=training,
        accountant=accountant,
        method=method,
        opts=opts,
        selection=selection or SelectionSpec(eval_every=10, across_seeds=across),
        seeds=seeds,
        name=f"ref-{method}",
    )


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


def test_the_reference_covers_every_built_in_method(reference):
    """A new built-in method adds its tiny study above and its plan to tests/data/method_plans.json."""
    assert tuple(reference) == BUILT_IN == methods.names()


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_built_in_method_plans_the_same_json_as_before(reference, name):
    plan = plan_study(method_study(name), 5000, 1000, "accuracy", coins=theory.SecretCoins(seed=7))
    assert json.dumps(plan.to_dict(), ensure_ascii=False) == json.dumps(reference[name], ensure_ascii=False)


def test_a_non_private_arm_runs_its_methods_configurations():
    """The non-private baseline asks the arm's method for its candidates: random's n draws (from one
    stream: n distinct configurations), the grid otherwise (10 draws from a space with distributions);
    its plan names the method "grid" with no options, as stored plans always did."""
    space = {"lr": {"log_uniform": [0.01, 1.0]}}
    study = dataclasses.replace(
        method_study("random"), strategies=(StrategyArm("dpsgd", space=space), StrategyArm("nodp", space=space))
    )
    plan = plan_study(study, 5000, 1000, "accuracy")
    _, baseline = plan.arms
    assert baseline.method == "grid" and baseline.options == {} and baseline.arm == "nodp@nodp"
    configs = [plan.runs[r].config for r in baseline.runs if plan.runs[r].replicate == 0]
    assert len(configs) == 2 and len({c["lr"] for c in configs}) == 2  # n = 2 draws, not one draw twice
    assert all(plan.runs[r].noise_multiplier == float("inf") for r in baseline.runs)

    other = dataclasses.replace(
        study, method=MethodSpec("linear-scaling"), strategies=(StrategyArm("nodp", space=space),)
    )
    (arm,) = plan_study(other, 5000, 1000, "accuracy").arms
    assert len(arm.runs) == 10 * len(other.seeds)  # a space with distributions: 10 draws


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_stored_plan_loads_and_writes_back_bit_for_bit(reference, name):
    plan = StudyPlan.from_dict(reference[name])
    assert json.dumps(plan.to_dict(), ensure_ascii=False) == json.dumps(reference[name], ensure_ascii=False)
    assert all(isinstance(r.eval_steps, tuple) for r in plan.runs.values())
    assert all(isinstance(a.epsilon, float) for a in plan.arms)  # "inf" read back as ∞


def test_the_plan_summary_notes_short_or_dense_sampling_once_per_arm():
    """``train.SamplingWarning`` at study level: a line per private arm whose runs sample q > 0.5 or take
    < 20 steps, computed from the stored plan (plans and their JSON unchanged); a hidden-K arm's goes to
    the diagnostics with its other notes."""
    from dptune.outputs import split_arm_notes

    plan = plan_study(method_study("linear-scaling"), 5000, 1000, "accuracy", coins=theory.SecretCoins(seed=7))
    odd = [r for r in plan.runs.values() if r.steps < 20 or 0.5 < r.sampling_rate < 1]
    release, secret = split_arm_notes(plan)
    notes = [n for n in release + secret if "advised: q ≤ 0.5, T ≥ 20" in n]
    assert odd and len(notes) == len({r.arm for r in odd if r.noise_multiplier != float("inf")})
    assert f"down to T = {min(r.steps for r in odd)}" in notes[0]
    long = dataclasses.replace(plan, runs={k: dataclasses.replace(r, steps=50) for k, r in plan.runs.items()})
    assert not [n for n in sum(split_arm_notes(long), []) if "advised" in n]


def test_repeat_and_select_refuses_candidates_with_another_event() -> None:
    """The bound is calibrated on one candidate's event and must hold for all: ``final_step`` makes a DP-GD
    run final-evaluated, one more private score release (found in review: ε 5.003 for a stated 5). The
    same space without that key plans."""
    from tune_helpers import planning_data

    def study(space: dict) -> Study:
        return make_study(
            planning_data(), strategy="dpgd", space=space, training=TrainingSpec(steps=200, full_batch=True),
            eps=5.0, delta=1e-5, accountant="rdp", method="repeat-and-select",
            opts={"mean": 4, "distribution": "poisson"}, seed=1,
            selection=SelectionSpec(mode="private", split="test", eval_every=20, noise_multiplier=40.0),
        )  # fmt: skip

    with pytest.raises(ConfigError, match="one privacy bound for every candidate"):
        plan_study(study({"final_step": [False, True], "lr": [0.1]}), 1000, 1000, "accuracy")
    assert plan_study(study({"lr": [0.1, 0.3]}), 1000, 1000, "accuracy").arms[0].runs is not None


def test_the_selection_noise_warning_does_not_reveal_a_secret_run_count() -> None:
    """The pre-run warning counted a Liu–Talwar arm's drawn runs' score releases: K, which the method keeps
    secret, printed unlabelled (found in review). For such an arm it now names no count."""
    from tune_helpers import planning_data

    from dptune.tune.plan import selection_noise_note

    notes, ks = set(), set()
    for seed in range(6):
        s = make_study(
            planning_data(), space={"lr": [0.01, 0.1, 1.0, 3.0]}, fixed={"clip": 1.0},
            training=TrainingSpec(steps=40, expected_batch_size=64), eps=3.0, method="liu-talwar",
            opts={"gamma": 0.2}, seed=seed,
            selection=SelectionSpec(mode="private", split="test", eval_every=10, noise_multiplier=200.0),
        )  # fmt: skip
        plan = plan_study(s, 1000, 1000, "accuracy")
        ks.add(len(plan.arms[0].runs))
        notes.add(selection_noise_note(plan, 200.0))
    assert len(ks) > 1 and len(notes) == 1 and None not in notes  # K varies; the note does not


@pytest.mark.parametrize("method", ["liu-talwar", "repeat-and-select"])
def test_a_hidden_k_arm_has_spent_its_whole_guarantee_from_the_plan_on(method: str) -> None:
    """Repeat-and-select with K = 0 reported spent ε = 0 next to its planned ε (found in review): K = 0 is one
    outcome of the mechanism, whose draws were made when planned; a partial spend would also hint at K."""
    from dptune.tune.results import spent

    plan = plan_study(method_study(method), 80, 40, "accuracy")
    for arm in plan.arms:
        assert spent(arm, plan, []) == (arm.guarantee["epsilon"], arm.delta)


def test_the_lt_vs_ma_figure_does_not_depend_on_the_secret_draws():
    """Found in review: the report's LT-vs-MA rows took the first drawn run's T and ν, a secret draw (a losing
    candidate's T, and K ≥ 2). They now come from the [training] geometry: the same for any coins."""
    from dptune.report.study import _lt_ma_rows

    space = {"lr": [0.1, 1.0], "steps": [5, 60]}
    study = dataclasses.replace(method_study("liu-talwar"), strategies=(StrategyArm("dpsgd", space=space),))
    plans = [plan_study(study, 5000, 1000, "accuracy", coins=theory.SecretCoins(seed=s)) for s in range(6)]
    drawn = {tuple(sorted(p.runs[r].steps for r in p.arms[0].runs)) for p in plans}
    assert len(drawn) > 1  # the coins drew different candidates
    rows = [_lt_ma_rows(p) for p in plans]
    assert rows[0] and all(r == rows[0] for r in rows)
    g = plans[0].arms[0].extra["public_geometry"]
    assert (g["steps"], g["sampling_rate"]) == (20, 0.01)  # [training]: steps 20, batch 50 of 5,000


@pytest.mark.parametrize("label", ["../../escaped", "a/b", "<script>$\\foo$", "x..y", ""])
def test_an_arm_label_is_one_safe_path_component(label):
    """A label names the arm's model folder and figure legends: '../x' wrote a model outside the study, and a
    '$' label crashed the report in matplotlib's mathtext half-way (found in review)."""
    with pytest.raises(ConfigError, match=r"strategies\[0\]\.label: must be letters"):
        dataclasses.replace(method_study("grid"), strategies=(StrategyArm("dpsgd", space={"lr": [0.1]}, label=label),))
    ok = StrategyArm("dpsgd", space={"lr": [0.1]}, label="dpsgd-small+v2.1")
    assert dataclasses.replace(method_study("grid"), strategies=(ok,)).strategies[0].key == "dpsgd-small+v2.1"


def test_a_study_without_a_batch_size_uses_train_s_default():
    """`dptune train` takes L = min(256, n/10) when none is given; a study refused it (found in review)."""
    from dptune.release.sampling import default_batch_size

    study = dataclasses.replace(method_study("grid"), training=TrainingSpec(steps=20))
    plan = plan_study(study, 5000, 1000, "accuracy")
    assert {r.sampling_rate for r in plan.runs.values()} == {default_batch_size(5000) / 5000}


def test_a_repeat_and_select_runs_noise_depends_on_its_own_configuration_only():
    """Found in review: one ν snapped over every drawn candidate (OSO's split moves it by ulps per candidate) put
    in the winner's card which losers were drawn, so K ≥ 2. Each run's ν now depends on its own configuration."""
    space = {"q_noise_multiplier": [5.0, 7.0, 11.0, 13.0, 17.0, 19.0, 23.0, 29.0]}
    study = dataclasses.replace(method_study("repeat-and-select"), strategies=(StrategyArm("oso", space=space),))
    seen: dict[float, set[float]] = {}
    for seed in range(8):
        plan = plan_study(study, 5000, 1000, "accuracy", coins=theory.SecretCoins(seed=seed))
        for r in plan.runs.values():
            seen.setdefault(r.config["q_noise_multiplier"], set()).add(r.noise_multiplier)
    assert len(seen) > 3 and all(len(nus) == 1 for nus in seen.values()), seen


def test_repeat_and_select_at_a_tiny_epsilon_is_one_clear_error(tmp_path):
    """Found in review: ε = 1e-3 ended in "math domain error" (RDP underflowing at a huge ν inside dp_accounting's
    repeat-and-select): such a ν is no certificate, and the refusal names the fix."""
    from dptune.tune import load_study_config

    (tmp_path / "s.toml").write_text(
        '[data]\nname = "digits"\n[model]\nname = "logistic_regression"\n[training]\nsteps = 20\n'
        'expected_batch_size = 64\n[budget]\nepsilon = 0.001\ndelta = 1e-5\n[method]\nname = "repeat-and-select"\n'
        'mean = 2\n[[strategies]]\nname = "dpsgd"\nspace = { lr = [0.1, 0.5] }\n'
    )
    with pytest.raises(ConfigError, match="could not reach ε ≤ 0.001.*Fix:"):
        plan_study(load_study_config(tmp_path / "s.toml"), 1150, 287, "accuracy")


def test_the_default_gamma_and_mean_keep_the_options_bounds():
    """Found in review: γ = 1/(grid size) and mean = grid size bypassed the bounds of the options (a 10⁵-cell grid
    planned 40k runs); gamma = true, mean = true were read as 1."""
    big = {"lr": [0.1 * (1 + i) for i in range(200)], "clip": [0.5 + i for i in range(100)]}  # 2·10⁴ cells
    for method, match in (("liu-talwar", "method.gamma"), ("repeat-and-select", "method.mean")):
        arms = (StrategyArm("dpsgd", space=big),)
        study = dataclasses.replace(method_study(method), strategies=arms, method=MethodSpec(method))  # defaults
        with pytest.raises(ConfigError, match=match):
            plan_study(study, 5000, 1000, "accuracy")
    with pytest.raises(ConfigError, match="method.gamma"):
        MethodSpec("liu-talwar", {"gamma": True})
    with pytest.raises(ConfigError, match="method.mean"):
        MethodSpec("repeat-and-select", {"mean": True})


@pytest.mark.parametrize("method", ["liu-talwar", "repeat-and-select"])
def test_an_invalid_candidate_is_refused_whatever_the_coins_draw(method):
    """Found in review: only the drawn candidates were checked, so OSO with q_noise_multiplier 0.5 in the space
    planned on some draws and was refused on others (13 of 30). Every candidate of a finite grid is checked first."""
    space = {"q_noise_multiplier": [0.5, 20.0, 25.0, 30.0]}
    study = dataclasses.replace(method_study(method), strategies=(StrategyArm("oso", space=space),))
    for seed in range(6):
        with pytest.raises(ConfigError, match="auxiliary query's noise multiplier"):
            plan_study(study, 5000, 1000, "accuracy", coins=theory.SecretCoins(seed=seed))
