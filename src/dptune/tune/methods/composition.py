"""Methods accounted by composition: grid, random, online, oracle (one planner, four candidate
rules; their guarantees: the table in docs/tuning.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import config_error
from dptune.outputs import up
from dptune.tune.builder import Builder, guarantee_scope, make_arm_id, seed_note
from dptune.tune.methods.base import TuningMethod, random_configurations
from dptune.tune.records import ArmPlan, calibrate_nu, choose_accountant, group_events
from dptune.tune.shapes import Shape, check_selection_budget, make_shape, snap, validate_shape

if TYPE_CHECKING:  # types only: the study spec validates through the methods
    from dptune.tune.spec import StrategyArm, Study


class Composition(TuningMethod):
    """The shared planner: one ν for all candidates' runs, calibrated so their composition meets ε."""

    needs_value_lists = True
    shared_noise = True  # oracle: False, each run is calibrated alone at ε (the search's cost not included)

    def plan(self, b: Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
        study, ctx = b.ctx.study, b.ctx
        arm_id = make_arm_id(arm.key, eps)
        S_ = len(study.seeds)
        per_seed = study.selection.across_seeds == "per-seed"
        # The candidates of each procedure: the grid (needs_value_lists), or Random's draws, one per
        # procedure. Seed r belongs to procedure r (per-seed selection) or to the single procedure 0.
        configs = {p: self.configurations(study, arm, p) for p in (range(S_) if per_seed else range(1))}
        shapes = {p: [make_shape(ctx, arm, c, f"{path}.space") for c in cs] for p, cs in configs.items()}
        proc_of = [r if per_seed else 0 for r in range(S_)]
        delta = study.budget.delta
        # The accounted runs, each group meeting ε: one seed's runs (each procedure's, per-seed), or all
        # seeds' runs together (account_seeds).
        groups = [proc_of] if study.budget.account_seeds else [[p] for p in sorted(set(proc_of))]

        def accounted(group: list[int], nu_of: Callable[[int, int], float]) -> dp_event.DpEvent:
            return group_events(s.event(nu_of(p, j)) for p in group for j, s in enumerate(shapes[p]))

        acc = choose_accountant(
            study.budget.accountant, accounted(groups[0], lambda p, j: 1.0), delta=study.budget.delta
        )
        alone = not self.shared_noise
        nus: dict[int, list[float]] = {}
        if alone:
            check_selection_budget(shapes[0][:1], eps, delta, acc, arm_id)

            @functools.cache
            def alone_nu(s: Shape) -> float:
                return calibrate_nu(s.event, eps, delta, acc, f"{arm_id} (oracle run)")

            nus = {p: [snap(alone_nu(s), [s]) for s in ss] for p, ss in shapes.items()}
        else:
            by_shapes: dict[tuple[Shape, ...], float] = {}  # groups with the same runs share one ν
            for g in groups:
                key = tuple(s for p in g for s in shapes[p])
                if key not in by_shapes:
                    check_selection_budget(list(key), eps, delta, acc, arm_id)

                    def group_at(v: float, g: list[int] = g) -> dp_event.DpEvent:
                        return accounted(g, lambda p, j: v)

                    nu = calibrate_nu(group_at, eps, delta, acc, arm_id)
                    by_shapes[key] = snap(nu, list(key))
                for p in set(g):
                    nus[p] = [by_shapes[key]] * len(shapes[p])
        for p, ss in shapes.items():
            for s, nu in zip(ss, nus[p], strict=True):
                validate_shape(s, nu, f"{path} ({arm_id})")
        run_ids = []
        for r, p in enumerate(proc_of):
            for j, (c, s, nu) in enumerate(zip(configs[p], shapes[p], nus[p], strict=True)):
                run_ids += b.add_candidate(arm, arm_id, "main", j, p, c, s, nu, replicates=[r])
        total = max(accounting.epsilon(accounted(g, lambda p, j: nus[p][j]), delta, acc) for g in groups)
        notes = seed_note(study)
        # The selection reads every seed's runs while one seed's are accounted: state what covers it.
        mixed = not per_seed and groups != [proc_of]
        whole = accounting.epsilon(accounted(proc_of, lambda p, j: nus[p][j]), delta, acc) if mixed else total
        if whole != total:
            notes.append(f"the selection's own guarantee, all {S_} seeds' runs composed: ε = {up(whole, 4)}.")
        if alone:
            notes.insert(
                0,
                f"oracle: every run alone is ({eps:g}, {delta:g})-DP; the HPO cost is NOT included "
                f"in ε = {eps:g} (Panda et al.'s grid-search baseline). The honest total is {up(total, 4)}.",
            )
        guarantee = {
            "kind": "composition",
            "epsilon": total,
            "delta": delta,
            "per": guarantee_scope(study),
            "accountant": acc,
            "runs_accounted": len(configs[0]) * (S_ if study.budget.account_seeds else 1),
            "selection_epsilon": whole,  # = epsilon unless the selection averages unaccounted seeds
        }
        extra = {"noise_multipliers": sorted({v for vs in nus.values() for v in vs}), "candidates": len(configs[0])}
        return self.arm_plan(b, arm, eps, accountant=acc, guarantee=guarantee, runs=run_ids, notes=notes, extra=extra)


class Grid(Composition):
    """Every configuration of the grid (Galli et al.'s and Mohapatra et al.'s "MA")."""

    name = "grid"
    aliases = ("ma",)


@dataclass(frozen=True)
class RandomOptions:
    n: int = 10  # configurations drawn

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise config_error(
                "method.n", f"must be an integer ≥ 1, got {self.n!r}", "e.g. n = 10 (n = 1: Panda's random search)"
            )


class Random(Composition):
    """``n`` configurations drawn from the space with the study seed (lists or distributions)."""

    name = "random"
    Options = RandomOptions
    needs_value_lists = False

    def configurations(self, study: Study, arm: StrategyArm, procedure: int = 0) -> list[dict[str, Any]]:
        # Each seed replicate is its own tuning procedure (per-seed selection): its own draw, so the
        # replicates measure random search, not one draw's luck three times.
        return random_configurations(study, arm, int(study.method_for(arm).options["n"]), procedure)


class Online(Composition):
    """The learning-rate grid of OSO-DPSGD, C learned online (Galli: "one hyperparameter fewer")."""

    name = "online"
    aliases = ("oso",)

    def check_arm(self, study: Study, arm: StrategyArm, path: str, private: bool) -> None:
        super().check_arm(study, arm, path, private)
        if arm.name != "oso":
            raise config_error(
                f"{path}.name",
                f"method 'online' tunes OSO-DPSGD only, got strategy {arm.name!r}",
                "use name = 'oso' (or 'online'), or method 'grid' for other strategies",
            )
        if set(arm.space) != {"lr"}:
            raise config_error(
                f"{path}.space",
                f"method 'online' searches the learning rate only, got {sorted(arm.space)}",
                "use space = { lr = [...] } (C is learned online: Galli's 'one hyperparameter fewer')",
            )


class Oracle(Composition):
    """Panda et al.'s grid-search baseline: every run alone at ε, the search's cost not included."""

    name = "oracle"
    shared_noise = False
