"""Run shapes: what the accountant needs to know about a planned run apart from its ν (``make_shape``:
strategy, q, T, evaluation schedule); ``Shape.event(ν)``, ``Shape.plan(ν)`` and ``snap`` (as ``plan_run``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError
from dptune.release.context import RunPlan, snap_noise
from dptune.release.ledger import compose
from dptune.release.sampling import check_steps, default_batch_size, sampling_rate_for, steps_for_epochs
from dptune.strategies import Strategy, make_strategy
from dptune.train import EvalSchedule
from dptune.tune.records import canonical, group_events
from dptune.tune.space import TRAINING_KEYS

if TYPE_CHECKING:  # types only: the study spec validates methods, which plan with this module
    from dptune.tune.spec import StrategyArm, Study


@dataclass
class Context:
    """What planning a run needs besides its configuration: the study and the data sizes."""

    study: Study
    n_train: int
    n_val: int


@dataclass(frozen=True)
class Shape:
    """What the accountant needs to know about a run (apart from ν), and its evaluation schedule."""

    strategy: Strategy
    n: int  # the training examples
    sampling_rate: float
    steps: int
    n_evals: int  # accounted evaluations (0 unless selection is private)
    eval_nu: float | None
    eval_steps: tuple[int, ...] = ()  # the steps evaluated during training (``EvalSchedule``)
    eval_final: bool = False  # whether the finalised parameters are evaluated too

    def plan(self, nu: float) -> RunPlan:
        """The plan of a run of this shape at ν (its accountant: the arm's, not the run's)."""
        return RunPlan(self.strategy, self.n, self.sampling_rate, self.steps, nu)

    def geometry(self, nu: float) -> dict[str, float]:
        """q, T and ν of a run of this shape: what a report may show of a hidden-K arm's plan (public)."""
        return {"sampling_rate": self.sampling_rate, "steps": self.steps, "noise_multiplier": nu}

    def event(self, nu: float) -> dp_event.DpEvent:
        train = self.plan(nu).event()
        if self.eval_nu is None or self.n_evals == 0:
            return canonical(train)
        return canonical(compose([(train, 1), (dp_event.GaussianDpEvent(self.eval_nu), self.n_evals)]))


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the strategy's hyperparameters, the training keys: steps, epochs, expected_batch_size)."""
    hp = {k: v for k, v in config.items() if k not in TRAINING_KEYS}
    tr = {k: v for k, v in config.items() if k in TRAINING_KEYS}
    return hp, tr


def run_geometry(ctx: Context, config: Mapping[str, Any], path: str) -> tuple[float, int]:
    """(q, T) of a configuration: the study's training settings, overridden by the config."""
    t = ctx.study.training
    _, tr = split_config(config)
    full = t.full_batch and "expected_batch_size" not in tr
    default = t.expected_batch_size or (None if full else default_batch_size(ctx.n_train))  # `dptune train`'s rule
    ebs = tr.get("expected_batch_size", default)  # (found in review: a study without a batch size was refused)
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
    """The shape of the run of ``config`` (the arm's fixed values added) on strategy arm ``arm``."""
    hp, _ = split_config({**arm.fixed, **config})
    try:
        strategy = make_strategy(arm.name, **hp)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    q, steps = run_geometry(ctx, {**arm.fixed, **config}, path)
    sel = ctx.study.selection
    ev = EvalSchedule.every(steps, sel.eval_every, strategy.finalizes, sel.checkpoint)
    n_evals, eval_nu = (len(ev.steps) + int(ev.final), sel.noise_multiplier) if sel.mode == "private" else (0, None)
    return Shape(strategy, ctx.n_train, q, steps, n_evals, eval_nu, ev.steps, ev.final)


def snap(nu: float, shapes: Iterable[Shape]) -> float:
    """``context.snap_noise`` for runs of these shapes: the smallest ν' ≥ ν their releases carry
    exactly. A strategy that refuses ν leaves it as is: ``validate_shape`` reports it with its path."""
    try:
        return snap_noise(nu, [s.plan(nu) for s in dict.fromkeys(shapes)])
    except ConfigError:
        return nu


def validate_shape(shape: Shape, nu: float, path: str) -> None:
    """Let the strategy refuse impossible settings (e.g. OSO's ν_q ≤ ν) before any training."""
    try:
        shape.strategy.validate_run(shape.plan(nu))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


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
