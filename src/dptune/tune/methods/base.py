"""The interface of a tuning method: one stateless ``TuningMethod`` subclass per file of ``tune/methods/``
(docs/tuning.md, "Adding a tuning method"); its ``Options`` dataclass's fields ARE its options."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from dptune.errors import config_error
from dptune.release.ledger import LedgerEntry
from dptune.tune import space as S
from dptune.tune import theory
from dptune.tune.builder import Builder, make_arm_id, procedures
from dptune.tune.records import ArmPlan, StudyPlan, entries_epsilon, group_events

if TYPE_CHECKING:  # types only: the study spec validates through the methods
    from dptune.tune.spec import StrategyArm, Study

Row = Mapping[str, Any]  # a run's row of the study store (status, score, config, ...)


@dataclass(frozen=True)
class NoOptions:
    """The options of a method that takes none."""


def _scored(r: Row) -> bool:
    return r["status"] in ("done", "diverged") and isinstance(r["score"], int | float) and math.isfinite(r["score"])


def random_configurations(study: Study, arm: StrategyArm, n: int, procedure: int = 0) -> list[dict[str, Any]]:
    """``n`` configurations drawn with the study seed, fresh per procedure (procedure 0: the old stream)."""
    rng = S.rng_for(study.seed, f"random/{arm.key}" + (f"/p{procedure}" if procedure else ""))
    return [S.draw(arm.space, rng) for _ in range(n)]


def secret_draws(
    b: Builder, arm: StrategyArm, procedures: int, draw_k: Callable[[theory.SecretCoins], int]
) -> tuple[list[int], list[tuple[int, int, dict[str, Any]]]]:
    """LT's and RS's search from the secret coins: (each procedure's K, (procedure, index, config) per run)."""
    ks, drawn = [], []
    for p in range(procedures):
        k = draw_k(b.coins)
        ks.append(k)
        drawn += [(p, j, S.draw(arm.space, b.coins)) for j in range(k)]
    return ks, drawn


def released_procedures(arm: ArmPlan, plan: StudyPlan, entries: Iterable[LedgerEntry]) -> int:
    """How many procedures a method's per-procedure bound is counted for in ``spent``: each procedure
    with a released run when the guarantee is per study, else one (the guarantee is per seed replicate)."""
    return len({plan.runs[e.run].procedure for e in entries}) if arm.guarantee.get("per") == "study" else 1


# ----------------------------------------------------------------------------- the interface
class TuningMethod:
    """A tuning method. Subclasses set ``name`` and override ``plan`` (at least)."""

    name: ClassVar[str]  # as written in study files: [method] name = "..."
    aliases: ClassVar[tuple[str, ...]] = ()  # other accepted spellings (lower case)
    Options: ClassVar[type] = NoOptions
    # Every axis of the space must be a list of values (a grid, not distributions).
    needs_value_lists: ClassVar[bool] = False
    # The guarantee covers only the selected candidate, with the number of runs K secret: reports
    # then publish neither K nor the other candidates. Such a method's guarantee "kind" is its name.
    hides_run_count: ClassVar[bool] = False
    # Some runs are planned with config None and configured from earlier runs' scores (``resolve``).
    adaptive: ClassVar[bool] = False
    # The budget is split evenly over the candidates: one ν for all their runs, which reports may
    # show next to the number of runs (never with ``hides_run_count``).
    shared_noise: ClassVar[bool] = False

    def parse_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``given`` checked against ``Options``, defaults filled, as a dict in field order."""
        allowed = [f.name for f in fields(self.Options)]
        if unknown := sorted(set(given) - set(allowed)):
            raise config_error(
                f"method.{unknown[0]}",
                f"method {self.name!r} has no option {unknown[0]!r}",
                f"its options are: {', '.join(allowed) or '(none)'}",
            )
        options = self.Options(**given)
        return {name: getattr(options, name) for name in allowed}

    def check_arm(self, study: Study, arm: StrategyArm, path: str, private: bool) -> None:
        """Refuse an arm this method cannot tune; by default a private arm needs a search space."""
        if not arm.space and private:
            raise config_error(
                f"{path}.space",
                "the search space is empty",
                "add at least one hyperparameter with values, e.g. space = { lr = [0.01, 0.1, 1.0] }",
            )

    def configurations(self, study: Study, arm: StrategyArm, procedure: int = 0) -> list[dict[str, Any]]:
        """The candidates of procedure ``procedure`` when fixed before any run, and of the arm's
        non-private baseline: by default the grid, or 10 draws when the space has distributions."""
        return S.grid(arm.space) if S.is_finite(arm.space) else random_configurations(study, arm, 10)

    def plan(self, b: Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
        """Plan the runs of ``arm`` at target ε (``b.add_candidate``) and return ``arm_plan``."""
        raise NotImplementedError

    def arm_plan(
        self,
        b: Builder,
        arm: StrategyArm,
        eps: float,
        *,
        accountant: str,
        guarantee: dict[str, Any],
        runs: list[str],
        notes: Iterable[str] = (),
        extra: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> ArmPlan:
        """The plan of ``arm`` at ε: ``runs``, their composed release event, δ, procedures, options."""
        study = b.ctx.study
        return ArmPlan(
            make_arm_id(arm.key, eps),
            arm.key,
            arm.name,
            eps,
            study.budget.delta,
            self.name,
            dict(study.method_for(arm).options if options is None else options),
            accountant,
            guarantee,
            group_events(b.runs[r].planned_event for r in runs),
            runs,
            procedures(study)[0],
            list(notes),
            dict(extra or {}),
        )

    def spent(self, arm: ArmPlan, plan: StudyPlan, entries: list[LedgerEntry]) -> tuple[float, float]:
        """(ε, δ) spent so far under the arm's guarantee, from its ledger entries: by default all released
        runs composed (per study) or the costliest seed replicate."""
        if arm.guarantee.get("per") == "study":
            return entries_epsilon(entries, arm.delta, arm.accountant), arm.delta
        by_rep: dict[int, list[LedgerEntry]] = defaultdict(list)
        for e in entries:
            by_rep[plan.runs[e.run].replicate].append(e)
        return max(entries_epsilon(v, arm.delta, arm.accountant) for v in by_rep.values()), arm.delta

    def select(self, arm: ArmPlan, plan: StudyPlan, runs: list[Row], across: str) -> tuple[list[Row], list[Any]]:
        """(the arm's result runs, one per procedure, or the best candidate's seeds; fit records): by
        default the best run per procedure (``"per-seed"``) or the best mean over seeds (``"mean"``)."""
        pick = max if plan.higher_is_better else min  # the first best: ties keep the earliest
        mean = across == "mean"
        groups: dict[int, list[Row]] = defaultdict(list)
        for r in runs:
            if _scored(r):
                groups[plan.runs[r["run_id"]].index if mean else r["procedure"]].append(r)
        ordered = [rs for _, rs in sorted(groups.items())]
        if not mean:
            return [pick(rs, key=lambda x: x["score"]) for rs in ordered], []
        if not ordered:
            return [], []
        best = pick(ordered, key=lambda rs: statistics.fmean(x["score"] for x in rs))
        return sorted(best, key=lambda x: x["replicate"]), []

    def resolve(
        self, plan: StudyPlan, arm: ArmPlan, rows: Mapping[str, Any], scores: Mapping[str, float | None]
    ) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
        """Adaptive methods: run_id → (config, fit record) for each unresolved run whose inputs are all
        finished, deterministic in the stored results. By default nothing."""
        return {}
