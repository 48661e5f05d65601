"""Planners: the whole study's privacy, fixed before any training.

Each tuning method turns the total budget (ε, δ) of one tuning procedure into
per-run noise multipliers ν and a planned ``DpEvent``. The *release plan* (every
release the study will make, all seeds included) becomes the study ledger's plan
(``Ledger.with_plan``): the runner refuses any run or release outside it, and the
final ledger must equal it. The *guarantee* is how the method accounts for the
released runs:

=================== ======================================================= =========
method              guarantee                                               accountant
=================== ======================================================= =========
grid / online       composition of the K configurations (one ν for all)     auto
random              composition of n configurations drawn from the space    auto
oracle              each run alone at ε (Panda's "grid search, HPO cost     auto
                    not included"); the honest composed total is shown too
liu-talwar          Liu & Talwar Thm 3.4: (3ε₁ + 3√(2δ₁), √(2δ₁)T_max + δ₂) closed form
repeat-and-select   RepeatAndSelectDpEvent(run, mean, shape) (Papernot &    rdp
                    Steinke 2022)
linear-scaling      composition of 2n sweep runs and the final run (μ-GDP   gdp (q=1)
                    exact at q = 1: μ = √(nμ₁² + nμ₂² + μ_f²))              else auto
=================== ======================================================= =========

``accountant = "auto"``: GDP when every release is an unsampled Gaussian (exact and
instant); else PLD (tightest) when the accounted event has ≤ 8 distinct atomic
events (calibration then takes a few seconds at most); else RDP. Liu–Talwar's δ₁ is
tiny (~1e-15), where PLD's tail truncation is unreliable, so it uses RDP;
repeat-and-select is only supported by RDP. The choice is recorded in the plan.

Seeds: by default seed repetitions are NOT accounted (as in the papers: they are
an evaluation device); the guarantee then holds per seed replicate.
``account_seeds = true`` composes them. Liu–Talwar and repeat-and-select with
``across_seeds = "mean"`` always account a candidate as the composite of its S seed
runs (their bound covers the selected candidate, which is S runs). Their K and
candidate configurations are secret draws (``theory.SecretCoins``), not study-seeded. All runs get distinct noise streams: runs
that shared noise would not compose as independent mechanisms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError
from dptune.ledger import atoms, compose, event_from_dict, event_to_dict
from dptune.sampling import check_steps, sampling_rate_for, steps_for_epochs, stream_seed
from dptune.steps import RunInfo
from dptune.strategies import Strategy, make_strategy
from dptune.tune import space as S
from dptune.tune import theory
from dptune.tune.spec import RS_DISTRIBUTIONS, TRAINING_KEYS, StrategyArm, Study

EVAL_LABEL = "selection/validation_score"
PLD_MAX_DISTINCT_ATOMS = 8


# ----------------------------------------------------------------------------- records
@dataclass
class RunSpec:
    """One planned run. A worker receives exactly this (plus data/model specs)."""

    run_id: str
    arm: str
    stage: str  # main | sweep<i> | final
    index: int  # candidate index within (arm, stage, procedure)
    procedure: int  # which selection procedure the run belongs to
    replicate: int  # index of the training seed in study.seeds
    seed: int  # training seed (model initialisation)
    run_seed: int  # seed of the run's sampling and noise streams (distinct for every run)
    config: dict[str, Any] | None  # hyperparameters (+ steps/epochs/expected_batch_size); None until resolved
    steps: int
    sampling_rate: float
    noise_multiplier: float
    eval_steps: tuple[int, ...]
    eval_final: bool
    eval_noise_multiplier: float | None  # private selection: std of the noise on the score's sum
    planned_event: dp_event.DpEvent

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["planned_event"] = event_to_dict(self.planned_event)
        d["eval_steps"] = list(self.eval_steps)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSpec:
        d = dict(d)
        d["planned_event"] = event_from_dict(d["planned_event"])
        d["eval_steps"] = tuple(d["eval_steps"])
        return cls(**d)


@dataclass
class ArmPlan:
    """One tuning procedure family: a strategy at one ε with one method."""

    arm: str
    label: str  # the strategy arm's key (label or name)
    strategy: str
    epsilon: float  # target total ε of one procedure (math.inf: non-private)
    delta: float
    method: str
    options: dict[str, Any]
    accountant: str
    guarantee: dict[str, Any]  # kind, epsilon, delta, per, details
    release_event: dp_event.DpEvent
    runs: list[str]
    procedures: int
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["release_event"] = event_to_dict(self.release_event)
        d["guarantee"] = _json_floats(self.guarantee)
        d["extra"] = _json_floats(self.extra)
        d["epsilon"] = _enc(self.epsilon)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArmPlan:
        d = dict(d)
        d["release_event"] = event_from_dict(d["release_event"])
        d["guarantee"] = _json_floats(d["guarantee"], decode=True)
        d["extra"] = _json_floats(d["extra"], decode=True)
        d["epsilon"] = _dec(d["epsilon"])
        return cls(**d)


@dataclass
class StudyPlan:
    arms: list[ArmPlan]
    runs: dict[str, RunSpec]
    release_event: dp_event.DpEvent
    n_train: int
    n_val: int
    metric: str
    higher_is_better: bool

    def arm(self, arm_id: str) -> ArmPlan:
        for a in self.arms:
            if a.arm == arm_id:
                return a
        raise KeyError(arm_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "arms": [a.to_dict() for a in self.arms],
            "runs": [r.to_dict() for r in self.runs.values()],
            "release_event": event_to_dict(self.release_event),
            "n_train": self.n_train,
            "n_val": self.n_val,
            "metric": self.metric,
            "higher_is_better": self.higher_is_better,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StudyPlan:
        runs = [RunSpec.from_dict(r) for r in d["runs"]]
        return cls(
            [ArmPlan.from_dict(a) for a in d["arms"]],
            {r.run_id: r for r in runs},
            event_from_dict(d["release_event"]),
            d["n_train"],
            d["n_val"],
            d["metric"],
            d["higher_is_better"],
        )


def _enc(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    return x


def _dec(x: Any) -> Any:
    return float(x) if x in ("inf", "-inf", "nan") else x


def _json_floats(d: Any, decode: bool = False) -> Any:
    f = _dec if decode else _enc
    if isinstance(d, Mapping):
        return {k: _json_floats(v, decode) for k, v in d.items()}
    if isinstance(d, list | tuple):
        return [_json_floats(v, decode) for v in d]
    return f(d)


# ----------------------------------------------------------------------------- run shapes
@dataclass(frozen=True)
class Shape:
    """What the accountant needs to know about a run (apart from ν)."""

    strategy: Strategy
    sampling_rate: float
    steps: int
    n_evals: int
    eval_nu: float | None

    def event(self, nu: float) -> dp_event.DpEvent:
        train = self.strategy.planned_event(nu, self.sampling_rate, self.steps)
        if self.eval_nu is None or self.n_evals == 0:
            return canonical(train)
        return canonical(compose([(train, 1), (dp_event.GaussianDpEvent(self.eval_nu), self.n_evals)]))


def eval_schedule(steps: int, every: int, checkpoint: str, strategy: Strategy) -> tuple[tuple[int, ...], bool]:
    """(steps evaluated during training, whether the finalised parameters are evaluated too).

    ``best``: every ``every`` steps and at the last step (Galli: every 50), plus the
    finalised parameters when the strategy post-processes them (e.g. DP-GD's free step).
    ``final``: only the parameters the run ends with."""
    finalizes = strategy.finalizes
    if checkpoint == "final":
        return ((), True) if finalizes else ((steps,), False)
    ts = tuple(range(every, steps + 1, every))
    if not ts or ts[-1] != steps:
        ts += (steps,)
    return ts, finalizes


@dataclass
class Context:
    study: Study
    n_train: int
    n_val: int


def _split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    hp = {k: v for k, v in config.items() if k not in TRAINING_KEYS}
    tr = {k: v for k, v in config.items() if k in TRAINING_KEYS}
    return hp, tr


def run_geometry(ctx: Context, config: Mapping[str, Any], path: str) -> tuple[float, int]:
    """(q, T) of a configuration: the study's training settings, overridden by the config."""
    t = ctx.study.training
    _, tr = _split_config(config)
    ebs = tr.get("expected_batch_size", t.expected_batch_size)
    full = t.full_batch and "expected_batch_size" not in tr
    # Name the field the value came from: the search space's, else [training]'s.
    field = f"{path}: expected_batch_size" if "expected_batch_size" in tr else "training.expected_batch_size"
    if ebs is not None and not (0 < ebs <= ctx.n_train):
        raise ConfigError(
            f"{field} = {ebs:g} is outside (0, n = {ctx.n_train}] (n: the training examples). "
            f"Fix: use a batch of at most {ctx.n_train}, or training.full_batch = true."
        )
    try:
        q = sampling_rate_for(ctx.n_train, ebs, full)
    except ConfigError as exc:  # a batch too small for any useful q
        raise ConfigError(f"{field}: {exc}") from None
    # 10¹² steps: a clear error naming the field, not a MemoryError while planning.
    if "steps" in tr or ("epochs" not in tr and t.steps is not None):
        steps = int(tr["steps"]) if "steps" in tr else int(t.steps)  # type: ignore[arg-type]
        check_steps(steps, f"{path}: steps = {steps}" if "steps" in tr else f"training.steps = {steps}")
    else:
        epochs = float(tr["epochs"]) if "epochs" in tr else float(t.epochs)  # type: ignore[arg-type]
        try:
            steps = steps_for_epochs(epochs, q)
        except ConfigError as exc:
            raise ConfigError(f"{path + ': epochs' if 'epochs' in tr else 'training.epochs'}: {exc}") from None
    if steps < 1:
        raise ConfigError(f"{path}: a run needs ≥ 1 step, got {steps}.")
    return q, steps


def make_shape(ctx: Context, arm: StrategyArm, config: Mapping[str, Any], path: str) -> Shape:
    hp, _ = _split_config({**arm.fixed, **config})
    try:
        strategy = make_strategy(arm.name, **hp)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    q, steps = run_geometry(ctx, {**arm.fixed, **config}, path)
    sel = ctx.study.selection
    ev_steps, ev_final = eval_schedule(steps, sel.eval_every, sel.checkpoint, strategy)
    private_eval = sel.mode == "private"
    return Shape(
        strategy,
        q,
        steps,
        len(ev_steps) + int(ev_final) if private_eval else 0,
        sel.noise_multiplier if private_eval else None,
    )


def release_multiplier(shape: Shape, nu: float, n: int) -> float:
    """The joint multiplier that the strategy's releases will actually carry for a planned ν.

    Strategies that split ν over several queries (OSO's q-query, the quantile count) recompute
    the joint multiplier (Σ ν_i⁻²)^(-1/2) from the parts, which can differ from ν in the last
    bits; the ledger compares events exactly, so such a run would be refused."""
    split = getattr(shape.strategy, "split", None)
    if split is None or not math.isfinite(nu):
        return accounting.joint_noise_multiplier([nu]) if math.isfinite(nu) else nu
    import inspect

    if "run" in inspect.signature(split).parameters:
        parts = split(RunInfo(nu, shape.sampling_rate, shape.sampling_rate * n, shape.steps, 1))
    else:
        parts = split(nu)
    return accounting.joint_noise_multiplier(parts)


def snap(nu: float, shapes: Iterable[Shape], n: int) -> float:
    """The smallest ν' ≥ ν (a few ulps up) whose releases round-trip exactly for every shape.

    More noise only lowers ε, so the snapped ν still meets the budget."""
    shapes = list({s: None for s in shapes})
    v = nu
    for _ in range(100_000):
        try:
            if all(release_multiplier(s, v, n) == v for s in shapes):
                return v
        except ConfigError:
            return nu  # validate_shape reports the real problem with a clear message
        v = math.nextafter(v, math.inf)
    raise ConfigError(
        f"could not find a noise multiplier near {nu} that the strategy releases exactly"
    )  # pragma: no cover


def validate_shape(shape: Shape, nu: float, n: int, path: str) -> None:
    """Let the strategy refuse impossible settings (e.g. OSO's ν_q ≤ ν) before any training."""
    run = RunInfo(nu, shape.sampling_rate, shape.sampling_rate * n, shape.steps, 1)
    try:
        shape.strategy.validate_run(run)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def canonical(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """The same composition, regrouped by atomic event (each atom once, self-composed ``count``
    times, in a fixed order) and built with tuples so that it is hashable.

    Composition is commutative, so every accountant gives the same ε; grouping turns K
    identical runs into one ``SelfComposedDpEvent`` (fast PLD), and hashability lets
    ``accounting.calibrate_event`` cache evaluations (a ``ComposedDpEvent`` built with a list
    is not hashable)."""
    counts = atoms(event)
    items = sorted(counts.items(), key=lambda kv: repr(kv[0]))
    evs = [e if n == 1 else dp_event.SelfComposedDpEvent(e, n) for e, n in items if n > 0]
    if not evs:
        return dp_event.NoOpDpEvent()
    return evs[0] if len(evs) == 1 else dp_event.ComposedDpEvent(tuple(evs))  # type: ignore[arg-type]


def group_events(events: Iterable[dp_event.DpEvent]) -> dp_event.DpEvent:
    """Compose events (canonical form: see ``canonical``)."""
    evs = list(events)
    if not evs:
        return dp_event.NoOpDpEvent()
    return canonical(dp_event.ComposedDpEvent(evs))


def choose_accountant(requested: str, event: dp_event.DpEvent, method: str) -> str:
    """Resolve ``auto`` deterministically (see module docstring)."""
    if method == "repeat-and-select":
        if requested not in ("auto", "rdp"):
            raise ConfigError(
                f"budget.accountant: repeat-and-select is accounted by RDP only (got {requested!r}). "
                "Fix: accountant = 'rdp' or 'auto'."
            )
        return "rdp"
    a = atoms(event)
    unsampled = all(isinstance(e, dp_event.GaussianDpEvent) for e in a)
    if requested == "gdp" and not unsampled:
        raise ConfigError(
            "budget.accountant = 'gdp' is exact only for full-batch Gaussian releases. "
            "Fix: use 'pld' or 'rdp' (or full_batch = true)."
        )
    if requested != "auto":
        return requested
    if method == "liu-talwar":
        return "rdp"
    if unsampled:
        return "gdp"
    return "pld" if len(a) <= PLD_MAX_DISTINCT_ATOMS else "rdp"


def check_selection_budget(shapes: Iterable[Shape], eps: float, delta: float, acc: str, what: str) -> None:
    """Private selection: the score releases alone must leave budget for training."""
    evs = [
        dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(s.eval_nu), s.n_evals)
        for s in shapes
        if s.eval_nu is not None and s.n_evals > 0
    ]
    if not evs:
        return
    e = accounting.epsilon(group_events(evs), delta, "rdp" if acc == "gdp" else acc)
    if e >= eps:
        raise ConfigError(
            f"{what}: the private validation scores alone spend ε = {e:.3g} ≥ {eps:g}. Fix: raise "
            "selection.noise_multiplier, evaluate less often (selection.eval_every, or checkpoint = 'final'), "
            "or raise budget.epsilon."
        )


def check_lt_selection_budget(shape: Shape, unit: int, lt: theory.LTParams, acc: str, what: str) -> None:
    """Liu–Talwar with private selection: each candidate gets only (ε₁, δ₁) (ε₁ ≈ ε/3), and its
    noisy validation scores are part of it. Scores that alone spend ε₁ leave no ν that works; say
    so, with a noise level for the scores that leaves half of ε₁ to training."""
    if shape.eval_nu is None or shape.n_evals == 0:
        return

    def scores(sigma: float) -> dp_event.DpEvent:
        return group_events([dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), shape.n_evals)] * unit)

    acc = "rdp" if acc == "gdp" else acc
    e = accounting.epsilon(scores(shape.eval_nu), lt.delta1, acc)
    if e < lt.eps1:
        return
    need = accounting.calibrate_event(scores, lt.eps1 / 2, lt.delta1, acc)
    raise ConfigError(
        f"{what}: Liu–Talwar gives each candidate run ε₁ = {lt.eps1:.4g} at δ₁ = {lt.delta1:.3g} (ε/3 − √(2δ₁), "
        f"Liu & Talwar 2019, Thm 3.4), and a run's {shape.n_evals} private validation scores "
        f"(selection.mode = 'private', σ = {shape.eval_nu:g}) alone spend ε = {e:.3g} of it. Fix: raise "
        f"selection.noise_multiplier to ≥ {accounting.round_up(need, 3):g} (half of ε₁ for the scores), evaluate "
        "less often (selection.eval_every, or checkpoint = 'final'), raise budget.epsilon, or select on a public "
        "split (selection.mode = 'public', split = 'test')."
    )


def calibrate_nu(
    make_event: Callable[[float], dp_event.DpEvent], eps: float, delta: float, acc: str, what: str
) -> float:
    """Smallest ν meeting the target (``accounting.calibrate_event``: it starts from the Gaussian-DP
    approximation, so an RDP pre-bracket would only add time: 0.4–0.6 s per 49-run grid)."""
    try:
        return accounting.calibrate_event(make_event, eps, delta, acc)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}. Fix: raise ε, shorten the runs or lower the number of runs.") from None


# ----------------------------------------------------------------------------- the planner
class _Builder:
    def __init__(self, ctx: Context, coins: theory.SecretCoins | None = None):
        self.ctx = ctx
        self.coins = coins if coins is not None else theory.SecretCoins()  # LT / RS draws: secret
        self.runs: dict[str, RunSpec] = {}
        self.run_seeds: dict[int, str] = {}  # run_seed → run_id: every run needs its own streams

    def add(
        self,
        arm_id: str,
        stage: str,
        index: int,
        procedure: int,
        replicate: int,
        config: dict[str, Any] | None,
        shape: Shape,
        nu: float,
    ) -> RunSpec:
        seed = self.ctx.study.seeds[replicate]
        run_id = f"{arm_id}/{stage}/p{procedure}/c{index:03d}/s{seed}"
        ev_steps, ev_final = eval_schedule(
            shape.steps, self.ctx.study.selection.eval_every, self.ctx.study.selection.checkpoint, shape.strategy
        )
        spec = RunSpec(
            run_id=run_id,
            arm=arm_id,
            stage=stage,
            index=index,
            procedure=procedure,
            replicate=replicate,
            # 63 bits (SQLite's INTEGER is signed 64-bit), all of which reach the streams.
            seed=seed,
            run_seed=stream_seed(seed, run_id),
            config=config,
            steps=shape.steps,
            sampling_rate=shape.sampling_rate,
            noise_multiplier=nu,
            eval_steps=ev_steps,
            eval_final=ev_final,
            eval_noise_multiplier=shape.eval_nu,
            planned_event=shape.event(nu),
        )
        if run_id in self.runs:  # pragma: no cover - ids are unique by construction
            raise RuntimeError(f"duplicate run id {run_id}")
        if spec.run_seed in self.run_seeds:  # ~N²/2⁶⁴: never seen, but shared noise would void ε
            raise RuntimeError(
                f"runs {self.run_seeds[spec.run_seed]} and {run_id} got the same run_seed "
                f"{spec.run_seed}; they would share their sampling and noise streams."
            )
        self.run_seeds[spec.run_seed] = run_id
        self.runs[run_id] = spec
        return spec


def _arm_id(label: str, eps: float) -> str:
    return f"{label}@eps={eps:g}" if math.isfinite(eps) else f"{label}@nodp"


def plan_study(
    study: Study, n_train: int, n_val: int, metric: str, coins: theory.SecretCoins | None = None
) -> StudyPlan:
    """Plan every run of ``study``: a pure function of the study and the data sizes, except
    Liu–Talwar's and repeat-and-select's secret draws (K and the candidates' configurations),
    which come from ``coins`` (default: the OS CSPRNG; ``theory.SecretCoins(seed)`` for a
    reproducible search with a secret seed). The store keeps the plan, so resume reuses them."""
    ctx = Context(study, n_train, n_val)
    b = _Builder(ctx, coins)
    arms: list[ArmPlan] = []
    for i, arm in enumerate(study.strategies):
        method = study.method_for(arm)
        path = f"strategies[{i}]"
        if not make_strategy(arm.name, **_split_config(dict(arm.fixed))[0]).private:
            arms.append(_plan_nodp(b, arm, path))
            continue
        for eps in study.budget.epsilon:
            planner = PLANNERS[method.name]
            arms.append(planner(b, arm, eps, path))
    release = group_events(r.planned_event for r in b.runs.values())
    from dptune.own import metric_higher

    return StudyPlan(arms, b.runs, release, n_train, n_val, metric, metric_higher(metric))


def _procedures(study: Study, composite: bool = False) -> tuple[int, int, int]:
    """(procedures P, accounted procedures P_acc, runs per candidate that are accounted).

    ``composite`` (Liu–Talwar, repeat-and-select): with ``across_seeds = "mean"`` a candidate
    IS its S seed runs (the selection reads their mean), so it is accounted as their composite
    whatever ``account_seeds`` says. These theorems bound the selected candidate only; there is
    no per-seed reading of them (one run per candidate would understate ε: 2 → 3.3 for S = 3)."""
    S_ = len(study.seeds)
    if study.selection.across_seeds == "mean":
        return 1, 1, (S_ if study.budget.account_seeds or composite else 1)
    return S_, (S_ if study.budget.account_seeds else 1), 1


def _seed_note(study: Study, composite: bool = False) -> list[str]:
    if len(study.seeds) == 1:
        return []
    if composite and study.selection.across_seeds == "mean":
        return [
            f"across_seeds = 'mean': a candidate is the composite of its {len(study.seeds)} seed runs (the "
            "selection reads their mean), calibrated as one mechanism; the guarantee is per study "
            "(account_seeds has no effect here)."
        ]
    if study.budget.account_seeds:
        return [f"all {len(study.seeds)} seed repetitions are accounted (account_seeds = true)."]
    if study.selection.across_seeds == "mean":
        return [
            f"seed repetitions are NOT accounted (the papers' convention) although the selection averages "
            f"{len(study.seeds)} seeds: the guarantee covers one seed's runs only."
        ]
    return [
        f"seed repetitions are NOT accounted (the papers' convention): each of the {len(study.seeds)} seed "
        "replicates is its own tuning procedure with this guarantee."
    ]


def _replicates_for(study: Study, procedure: int) -> list[int]:
    """Seed indices whose runs belong to a procedure (mean mode: all seeds)."""
    if study.selection.across_seeds == "mean":
        return list(range(len(study.seeds)))
    return [procedure]


# -- composition methods ------------------------------------------------------
def _plan_composition(b: _Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
    study, ctx = b.ctx.study, b.ctx
    method = study.method_for(arm)
    arm_id = _arm_id(arm.key, eps)
    if method.name == "random":
        rng = S.rng_for(study.seed, f"random/{arm.key}")
        configs = [S.draw(arm.space, rng) for _ in range(int(method.options["n"]))]
    else:
        configs = S.grid(arm.space)
    shapes = [make_shape(ctx, arm, c, f"{path}.space") for c in configs]
    P, P_acc, _ = _procedures(study)
    delta = study.budget.delta
    # The accounted runs: one seed's runs, or all of them (account_seeds).
    reps_acc = range(len(study.seeds)) if study.budget.account_seeds else range(1)

    def accounted(nus: list[float]) -> dp_event.DpEvent:
        return group_events(s.event(nu) for _ in reps_acc for s, nu in zip(shapes, nus, strict=True))

    probe = accounted([1.0] * len(shapes))
    acc = choose_accountant(study.budget.accountant, probe, method.name)
    check_selection_budget(
        [s for _ in reps_acc for s in shapes] if method.name != "oracle" else shapes[:1], eps, delta, acc, arm_id
    )
    if method.name == "oracle":
        cache: dict[Shape, float] = {}
        for s in shapes:
            if s not in cache:
                cache[s] = calibrate_nu(s.event, eps, delta, acc, f"{arm_id} (oracle run)")
        nus = [snap(cache[s], [s], ctx.n_train) for s in shapes]
    else:
        nu = calibrate_nu(lambda v: accounted([v] * len(shapes)), eps, delta, acc, arm_id)
        nus = [snap(nu, shapes, ctx.n_train)] * len(shapes)
    for s, nu in zip(shapes, nus, strict=True):
        validate_shape(s, nu, ctx.n_train, f"{path} ({arm_id})")
    run_ids = []
    for r in range(len(study.seeds)):
        procedure = r if study.selection.across_seeds == "per-seed" else 0
        for j, (c, s, nu) in enumerate(zip(configs, shapes, nus, strict=True)):
            run_ids.append(b.add(arm_id, "main", j, procedure, r, {**dict(arm.fixed), **c}, s, nu).run_id)
    total = accounting.epsilon(accounted(nus), delta, acc)
    notes = _seed_note(study)
    if method.name == "oracle":
        notes.insert(
            0,
            f"oracle: every run alone is ({eps:g}, {delta:g})-DP; the HPO cost is NOT included "
            f"in ε = {eps:g} (Panda et al.'s grid-search baseline). The honest total is {total:.4g}.",
        )
    per = "study" if (study.budget.account_seeds or len(study.seeds) == 1) else "seed replicate"
    guarantee = {
        "kind": "composition",
        "epsilon": total,
        "delta": delta,
        "per": per,
        "accountant": acc,
        "runs_accounted": len(configs) * len(reps_acc),
    }
    return ArmPlan(
        arm_id,
        arm.key,
        arm.name,
        eps,
        delta,
        method.name,
        dict(method.options),
        acc,
        guarantee,
        group_events(b.runs[r].planned_event for r in run_ids),
        run_ids,
        P,
        notes,
        {"noise_multipliers": sorted(set(nus)), "candidates": len(configs)},
    )


# -- non-private baseline ----------------------------------------------------
def _plan_nodp(b: _Builder, arm: StrategyArm, path: str) -> ArmPlan:
    study, ctx = b.ctx.study, b.ctx
    method = study.method_for(arm)
    arm_id = _arm_id(arm.key, math.inf)
    configs = (
        S.grid(arm.space)
        if S.is_finite(arm.space) and method.name != "random"
        else [
            S.draw(arm.space, S.rng_for(study.seed, f"random/{arm.key}"))
            for _ in range(int(method.options.get("n", 10)))
        ]
    )
    P, _, _ = _procedures(study)
    run_ids = []
    for r in range(len(study.seeds)):
        procedure = r if study.selection.across_seeds == "per-seed" else 0
        for j, c in enumerate(configs):
            s = make_shape(ctx, arm, c, f"{path}.space")
            run_ids.append(b.add(arm_id, "main", j, procedure, r, {**dict(arm.fixed), **c}, s, math.inf).run_id)
    guarantee = {"kind": "nonprivate", "epsilon": math.inf, "delta": study.budget.delta, "per": "study"}
    return ArmPlan(
        arm_id,
        arm.key,
        arm.name,
        math.inf,
        study.budget.delta,
        "grid",
        {},
        "none",
        guarantee,
        group_events(b.runs[r].planned_event for r in run_ids),
        run_ids,
        P,
        ["non-private baseline: every step is a NonPrivateDpEvent (ε = ∞)."],
        {},
    )


# -- Liu–Talwar ------------------------------------------------------------------
def _plan_lt(b: _Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
    study, ctx = b.ctx.study, b.ctx
    method = study.method_for(arm)
    arm_id = _arm_id(arm.key, eps)
    opts = method.options
    gamma = float(opts["gamma"]) if opts["gamma"] is not None else 1.0 / S.size(arm.space)
    P, P_acc, unit = _procedures(study, composite=True)
    delta = study.budget.delta
    lt = theory.lt_solve(eps / P_acc, delta / P_acc, gamma, float(opts["delta2_fraction"]))
    cache: dict[Shape, float] = {}

    def nu_for(shape: Shape) -> float:
        if shape not in cache:
            acc_ = choose_accountant(study.budget.accountant, shape.event(1.0), "liu-talwar")
            check_lt_selection_budget(shape, unit, lt, acc_, arm_id)
            cache[shape] = snap(
                calibrate_nu(
                    lambda v: group_events([shape.event(v)] * unit),
                    lt.eps1,
                    lt.delta1,
                    acc_,
                    f"{arm_id} (Liu–Talwar run at ε₁ = {lt.eps1:.4g}, δ₁ = {lt.delta1:.3g})",
                ),
                [shape],
                ctx.n_train,
            )
        return cache[shape]

    run_ids, ks = [], []
    for p in range(P):
        rng = b.coins  # secret: K and the configurations (theory.SecretCoins)
        k = theory.lt_stops(gamma, lt.t_max, rng)
        ks.append(k)
        for j in range(k):
            c = S.draw(arm.space, rng)
            s = make_shape(ctx, arm, c, f"{path}.space")
            nu = nu_for(s)
            validate_shape(s, nu, ctx.n_train, f"{path} ({arm_id})")
            for r in _replicates_for(study, p):
                run_ids.append(b.add(arm_id, "main", j, p, r, {**dict(arm.fixed), **c}, s, nu).run_id)
    total = (lt.total[0] * P_acc, lt.total[1] * P_acc)
    acc = choose_accountant(study.budget.accountant, next(iter(cache)).event(1.0), "liu-talwar") if cache else "rdp"
    guarantee = {
        "kind": "liu-talwar",
        "epsilon": total[0],
        "delta": total[1],
        "per": "study" if (P_acc == P or len(study.seeds) == 1) else "seed replicate",
        "accountant": acc,
        "eps1": lt.eps1,
        "delta1": lt.delta1,
        "gamma": gamma,
        "delta2": lt.delta2,
        "t_max": lt.t_max,
        "procedures_accounted": P_acc,
        "formula": "(3ε₁ + 3√(2δ₁), √(2δ₁)·T_max + δ₂) per procedure (Liu & Talwar 2019, Thm 3.4)",
    }
    notes = _seed_note(study, composite=True) + [
        f"Liu–Talwar random stopping: γ = {gamma:.4g}, T_max = {lt.t_max}, each run ({lt.eps1:.4g}, {lt.delta1:.3g})-DP; "
        f"runs drawn per procedure: {ks}. The guarantee covers releasing ONLY the selected candidate: the study "
        "directory (all runs, their number, their scores) is internal and must not be published.",
    ]
    return ArmPlan(
        arm_id,
        arm.key,
        arm.name,
        eps,
        delta,
        "liu-talwar",
        dict(opts),
        acc,
        guarantee,
        group_events(b.runs[r].planned_event for r in run_ids),
        run_ids,
        P,
        notes,
        {"runs_per_procedure": ks, "noise_multipliers": sorted(set(cache.values()))},
    )


# -- repeat-and-select ----------------------------------------------------------
def _plan_rs(b: _Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
    study, ctx = b.ctx.study, b.ctx
    method = study.method_for(arm)
    arm_id = _arm_id(arm.key, eps)
    opts = method.options
    dist = opts["distribution"]
    shape_param = float(opts["shape"]) if dist == "negative-binomial" else RS_DISTRIBUTIONS[dist]
    mean = float(opts["mean"]) if opts["mean"] is not None else float(S.size(arm.space))
    if mean < 1:
        raise ConfigError("method.mean must be ≥ 1 (dp_accounting's repeat-and-select needs it). Fix: mean = 10.")
    if any(k in TRAINING_KEYS for k in arm.space):
        raise ConfigError(
            f"{path}.space: repeat-and-select needs one privacy bound for every candidate; searching "
            f"{[k for k in arm.space if k in TRAINING_KEYS]} changes it. Fix: fix the run length/batch."
        )
    P, P_acc, unit = _procedures(study, composite=True)
    delta = study.budget.delta
    first = S.draw(arm.space, S.rng_for(study.seed, "probe"))
    shape0 = make_shape(ctx, arm, first, f"{path}.space")
    acc = choose_accountant(study.budget.accountant, shape0.event(1.0), "repeat-and-select")

    def event(v: float) -> dp_event.DpEvent:
        rs = theory.repeat_and_select_event(group_events([shape0.event(v)] * unit), mean, shape_param)
        return rs if P_acc == 1 else dp_event.SelfComposedDpEvent(rs, P_acc)

    drawn = []
    ks = []
    for p in range(P):
        rng = b.coins  # secret: K and the configurations (theory.SecretCoins)
        k = theory.sample_repetitions(mean, shape_param, rng)
        ks.append(k)
        for j in range(k):
            c = S.draw(arm.space, rng)
            drawn.append((p, j, c, make_shape(ctx, arm, c, f"{path}.space")))
    nu = snap(calibrate_nu(event, eps, delta, acc, arm_id), [shape0] + [d[3] for d in drawn], ctx.n_train)
    total = accounting.epsilon(event(nu), delta, acc)
    run_ids = []
    for p, j, c, s in drawn:
        validate_shape(s, nu, ctx.n_train, f"{path} ({arm_id})")
        for r in _replicates_for(study, p):
            run_ids.append(b.add(arm_id, "main", j, p, r, {**dict(arm.fixed), **c}, s, nu).run_id)
    guarantee = {
        "kind": "repeat-and-select",
        "epsilon": total,
        "delta": delta,
        "per": "study" if (P_acc == P or len(study.seeds) == 1) else "seed replicate",
        "accountant": acc,
        "mean": mean,
        "shape": shape_param,
        "distribution": dist,
        "procedures_accounted": P_acc,
        "unit_event": event_to_dict(group_events([shape0.event(nu)] * unit)),
        "event": "RepeatAndSelectDpEvent(run, mean, shape) (Papernot & Steinke 2022), RDP",
    }
    notes = _seed_note(study, composite=True) + [
        f"repeat-and-select: K ~ {dist} with mean {mean:g}; runs drawn per procedure: {ks}. Only the best run may be "
        "released: the study directory is internal and must not be published.",
    ]
    if dist == "poisson":
        notes.append("Poisson K may be 0: that procedure then returns no candidate.")
    return ArmPlan(
        arm_id,
        arm.key,
        arm.name,
        eps,
        delta,
        "repeat-and-select",
        dict(opts),
        acc,
        guarantee,
        group_events(b.runs[r].planned_event for r in run_ids),
        run_ids,
        P,
        notes,
        {"runs_per_procedure": ks, "noise_multipliers": [nu]},
    )


# -- linear scaling (Panda et al. 2024) ----------------------------------------
def _plan_ls(b: _Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
    study, ctx = b.ctx.study, b.ctx
    method = study.method_for(arm)
    arm_id = _arm_id(arm.key, eps)
    o = method.options
    delta = study.budget.delta
    P, P_acc, _ = _procedures(study)
    se = o["sweep_epsilons"]
    # {fraction = [...]}: each sweep at that share of this arm's target ε (spec._check_method_options)
    sweep_eps = (
        [float(f"{float(f) * eps:.12g}") for f in se["fraction"]] if isinstance(se, Mapping) else [float(e) for e in se]
    )
    n = int(o["runs_per_sweep"])
    lr_lo, lr_hi = S.bounds(arm.space["lr"])
    t_lo, t_hi = S.bounds(arm.space["steps"])
    r_lo, r_hi = lr_lo * t_lo, lr_hi * t_hi
    if r_lo <= 0:
        raise ConfigError(f"{path}.space: linear-scaling needs lr > 0 and steps ≥ 1.")
    t_final = int(t_hi) if o["final_steps"] == "max" else int(o["final_steps"])
    probe = make_shape(ctx, arm, {"lr": lr_lo, "steps": int(t_lo)}, f"{path}.space")
    acc = choose_accountant(study.budget.accountant, probe.event(1.0), "linear-scaling")
    per_run_cache: dict[tuple[Shape, float], float] = {}

    def nu_at(shape: Shape, e: float) -> float:
        if (shape, e) not in per_run_cache:
            per_run_cache[(shape, e)] = snap(
                calibrate_nu(shape.event, e, delta, acc, f"{arm_id} (sweep run at ε = {e:g})"), [shape], ctx.n_train
            )
        return per_run_cache[(shape, e)]

    sweeps: list[list[list[tuple[dict[str, Any], Shape, float]]]] = []  # [procedure][sweep][run]
    for p in range(P):
        rng = S.rng_for(study.seed, f"linear-scaling/{arm_id}/{p}")
        per_p = []
        for e in sweep_eps:
            runs = []
            for _ in range(n):
                c = _decompose(rng, arm.space, r_lo, r_hi, lr_lo, lr_hi, o["r_sampling"])
                s = make_shape(ctx, arm, c, f"{path}.space")
                runs.append((c, s, nu_at(s, e)))
            per_p.append(runs)
        sweeps.append(per_p)
    final_shape = make_shape(ctx, arm, {"lr": lr_lo, "steps": t_final}, f"{path}.space")

    def total_event(group: list[int], v: float) -> dp_event.DpEvent:
        evs = [s.event(nu) for p in group for runs in sweeps[p] for (_, s, nu) in runs]
        evs += [final_shape.event(v)] * len(group)
        return group_events(evs)

    groups = [list(range(P))] if P_acc == P else [[p] for p in range(P)]
    check_selection_budget(
        [s for p in groups[0] for runs in sweeps[p] for (_, s, _) in runs] + [final_shape] * len(groups[0]),
        eps,
        delta,
        acc,
        arm_id,
    )
    final_nu: dict[int, float] = {}
    for g in groups:
        sweeps_only = group_events(s.event(nu) for p in g for runs in sweeps[p] for (_, s, nu) in runs)
        if accounting.epsilon(sweeps_only, delta, acc) >= eps:
            raise ConfigError(
                f"{arm_id}: the sweeps alone spend ε ≥ {eps:g}. Fix: lower method.sweep_epsilons "
                "or method.runs_per_sweep, or raise budget.epsilon."
            )
        v = snap(
            calibrate_nu(lambda x, g=g: total_event(g, x), eps, delta, acc, f"{arm_id} (final run)"),
            [final_shape],
            ctx.n_train,
        )
        for p in g:
            final_nu[p] = v
    run_ids = []
    eps_final = {}
    for p in range(P):
        for i, runs in enumerate(sweeps[p]):
            for j, (c, s, nu) in enumerate(runs):
                validate_shape(s, nu, ctx.n_train, f"{path} ({arm_id})")
                run_ids.append(b.add(arm_id, f"sweep{i}", j, p, p, {**dict(arm.fixed), **c}, s, nu).run_id)
        validate_shape(final_shape, final_nu[p], ctx.n_train, f"{path} ({arm_id})")
        run_ids.append(b.add(arm_id, "final", 0, p, p, None, final_shape, final_nu[p]).run_id)
        eps_final[p] = accounting.epsilon(final_shape.event(final_nu[p]), delta, acc)
    total = max(accounting.epsilon(total_event(g, final_nu[g[0]]), delta, acc) for g in groups)
    mus = None
    if acc == "gdp":
        mus = {
            "sweep_mu": [accounting.gdp_mu_for_epsilon(e, delta) for e in sweep_eps],
            "final_mu": {p: accounting.gdp_mu_of_event(final_shape.event(final_nu[p])) for p in range(P)},
        }
    guarantee = {
        "kind": "composition",
        "epsilon": total,
        "delta": delta,
        "accountant": acc,
        "per": "study" if (P_acc == P or len(study.seeds) == 1) else "seed replicate",
        "formula": "μ = √(n·μ₁² + n·μ₂² + μ_f²) (Panda et al. App. A.7)" if acc == "gdp" else "composition",
    }
    extra = {
        "sweep_epsilons": sweep_eps,
        "runs_per_sweep": n,
        "fit": o["fit"],
        "fit_axis": o["fit_axis"],
        "r_bounds": [r_lo, r_hi],
        "lr_bounds": [lr_lo, lr_hi],
        "steps_bounds": [t_lo, t_hi],
        "final_steps": t_final,
        "final_epsilon": {str(p): e for p, e in eps_final.items()},
        "final_noise_multiplier": {str(p): v for p, v in final_nu.items()},
        **(
            {"gdp": {"sweep_mu": mus["sweep_mu"], "final_mu": {str(k): v for k, v in mus["final_mu"].items()}}}
            if mus
            else {}
        ),
    }
    notes = _seed_note(study) + [
        f"linear scaling: {n} runs at each ε ∈ {sweep_eps}, then one final run at ε_f ≈ "
        f"{min(eps_final.values()):.4g} with T_f = {t_final}; η_f = r*/T_f with r* from a {o['fit']} fit of r = η·T "
        f"against {o['fit_axis']}.",
    ]
    return ArmPlan(
        arm_id,
        arm.key,
        arm.name,
        eps,
        delta,
        "linear-scaling",
        dict(o),
        acc,
        guarantee,
        group_events(b.runs[r].planned_event for r in run_ids),
        run_ids,
        P,
        notes,
        extra,
    )


def _decompose(
    rng, space: Mapping[str, Any], r_lo: float, r_hi: float, lr_lo: float, lr_hi: float, sampling: str
) -> dict[str, Any]:
    """Draw r (uniform or log-uniform in [r_min, r_max]) and split it into (η, T) with η·T = r,
    η_min ≤ η ≤ η_max and T on the steps axis (Panda Alg. 1, "decompose r into η, T without
    exceeding T_max or η_max"; §A.3, method 2: T from the steps axis, η = r/T).

    T is drawn from the steps axis conditioned on η = r/T being in range: by rejection first
    (the draws of earlier versions, so existing plans keep their configurations), then, when
    the feasible T are too rare for rejection, directly from them. Only when no integer T on
    the axis gives η in range is η clamped (r then moves to the nearest reachable product)."""
    r = rng.uniform(r_lo, r_hi) if sampling == "uniform" else math.exp(rng.uniform(math.log(r_lo), math.log(r_hi)))
    for _ in range(100):
        T = int(S.draw_value(space["steps"], rng))
        lr = r / T
        if lr_lo <= lr <= lr_hi:
            return {"lr": float(lr), "steps": T}
    return split_r(r, space["steps"], lr_lo, lr_hi, rng)


def split_r(r: float, steps_axis: Any, lr_lo: float, lr_hi: float, rng) -> dict[str, Any]:
    """(η, T) with η·T = r, η ∈ [η_min, η_max], T drawn from the steps axis restricted to the
    T that allow it (uniformly in T, or log-uniformly for ``int_log_uniform``); if none does,
    the axis's T nearest to the feasible interval and η clamped to its range."""
    t_min, t_max = r / lr_hi, r / lr_lo  # the real interval of T with η = r/T in range
    if isinstance(steps_axis, Mapping):
        dist = next(iter(steps_axis))
        lo, hi = S.bounds(steps_axis)
        a, b = max(math.ceil(lo), math.ceil(t_min * (1 - 1e-12))), min(math.floor(hi), math.floor(t_max * (1 + 1e-12)))
        if a <= b:
            if dist == "int_log_uniform":
                T = int(min(max(round(math.exp(rng.uniform(math.log(a), math.log(b)))), a), b))
            else:
                T = int(rng.integers(a, b + 1))
            return {"lr": float(min(max(r / T, lr_lo), lr_hi)), "steps": T}
        support = sorted(
            {
                math.ceil(lo),
                math.floor(hi),
                min(max(a, math.ceil(lo)), math.floor(hi)),
                max(min(b, math.floor(hi)), math.ceil(lo)),
            }
        )
    else:
        support = sorted({int(v) for v in steps_axis})
        ok = [T for T in support if t_min * (1 - 1e-12) <= T <= t_max * (1 + 1e-12)]
        if ok:
            T = ok[int(rng.integers(len(ok)))]
            return {"lr": float(min(max(r / T, lr_lo), lr_hi)), "steps": T}
    # No T on the axis reaches r: the one whose clamped η gives the nearest product (in log r).
    T = min(support, key=lambda t: abs(math.log(min(max(r / t, lr_lo), lr_hi) * t / r)))
    return {"lr": float(min(max(r / T, lr_lo), lr_hi)), "steps": int(T)}


def resolve_final_config(
    plan: StudyPlan, arm: ArmPlan, procedure: int, scores: Mapping[str, float | None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Panda Alg. 2: best r per sweep → polynomial fit r(x) → r* at the final run's x → (η_f, T_f).

    ``scores``: run_id → selection score (None/NaN for diverged runs). Returns (config,
    fit record). Deterministic in the stored scores, so a resumed study resolves the same
    configuration."""
    import numpy as np

    ex = arm.extra
    higher = plan.higher_is_better
    xs, rs = [], []
    delta = arm.delta
    for i, e in enumerate(ex["sweep_epsilons"]):
        best = None
        for rid in arm.runs:
            run = plan.runs[rid]
            if run.stage != f"sweep{i}" or run.procedure != procedure:
                continue
            s = scores.get(rid)
            if s is None or not math.isfinite(s):
                continue
            if best is None or (s > best[0] if higher else s < best[0]):
                best = (s, run.config["lr"] * run.config["steps"])
        if best is not None:
            x = e if ex["fit_axis"] == "epsilon" else accounting.gdp_mu_for_epsilon(e, delta)
            xs.append(x)
            rs.append(best[1])
    eps_f = float(ex["final_epsilon"][str(procedure)])
    x_f = eps_f if ex["fit_axis"] == "epsilon" else accounting.gdp_mu_for_epsilon(eps_f, delta)
    r_lo, r_hi = ex["r_bounds"]
    deg = 2 if ex["fit"] == "quadratic" else 1
    if len(xs) >= deg + 1:
        coef = np.polyfit(np.asarray(xs), np.asarray(rs), deg)
        r_star = float(np.polyval(coef, x_f))
        how = "fit"
    elif rs:
        coef, r_star, how = None, float(rs[-1]), "best sweep point (too few finite sweeps to fit)"
    else:
        coef, r_star, how = None, float(r_lo), "r_min (every sweep run diverged)"
    r_star = float(min(max(r_star, r_lo), r_hi))
    t_f = int(ex["final_steps"])
    lr_lo, lr_hi = ex["lr_bounds"]
    lr = float(min(max(r_star / t_f, lr_lo), lr_hi))
    final = next(
        plan.runs[r] for r in arm.runs if plan.runs[r].stage == "final" and plan.runs[r].procedure == procedure
    )
    fixed = {k: v for k, v in (plan.runs[arm.runs[0]].config or {}).items() if k not in ("lr", "steps")}
    fit = {
        "points": [[x, r] for x, r in zip(xs, rs, strict=True)],
        "coef": [float(c) for c in coef] if coef is not None else None,
        "x_final": x_f,
        "r_star": r_star,
        # What the final run trains with: T_f was fixed at planning time (its ν is calibrated for
        # it), so an r* below η_min·T_f (or above η_max·T_f) is run at the nearest reachable r.
        "r_final": lr * t_f,
        "how": how,
        "axis": ex["fit_axis"],
    }
    return {**fixed, "lr": lr, "steps": final.steps}, fit


PLANNERS: dict[str, Callable[[_Builder, StrategyArm, float, str], ArmPlan]] = {
    "grid": _plan_composition,
    "online": _plan_composition,
    "random": _plan_composition,
    "oracle": _plan_composition,
    "liu-talwar": _plan_lt,
    "repeat-and-select": _plan_rs,
    "linear-scaling": _plan_ls,
}
