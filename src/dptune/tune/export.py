"""A finished study's deliverable: each arm's selected model and card in ``release/models/<arm>/``, from
the kept checkpoints (no retraining, no new release); then the other checkpoints are pruned."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dptune._version import __version__
from dptune.deliverable import (
    CHECKPOINTS_DIR,
    COVERED,
    MODELS_DIR,
    NOT_COVERED,
    checkpoint_path,
    load_checkpoint,
    save_text,
    write_model,
)
from dptune.errors import ConfigError
from dptune.outputs import diagnostics_dir, hides_run_count, labelled_json, randomness_statement, release_dir, up
from dptune.release.ledger import Ledger
from dptune.tune import results
from dptune.tune.records import ArmPlan, RunSpec


def study_ledger_digest(study_dir: str | Path) -> str:
    """``Ledger.digest()`` of the private arms' ledger (their runs' entries, run-tagged). A non-private arm's
    entries are left out: they record when its noiseless run diverged, a function of the data (review)."""
    _, plan, _, entries = results.load_study(study_dir)
    private = {r for a in plan.arms if math.isfinite(a.epsilon) for r in a.runs}
    led = Ledger()
    for e in entries:
        if e.run in private:
            led.record(e.event, e.label, count=e.count, components=e.components, run=e.run)
    return led.digest()


def export_study(
    study_dir: str | Path, arm: str | None = None, out: str | Path | None = None, *, skip_missing: bool = False
) -> list[Path]:
    """Write ``release/models/<arm>/`` for ``arm`` (default all) from the stored checkpoints (``out``)."""
    d = Path(study_dir)
    base = Path(out) if out is not None else d
    cfg, plan, rows, _ = results.load_study(d)
    if not results.study_status(d)["complete"]:  # no run counts: they reveal Liu–Talwar's secret K (an audit)
        raise ConfigError(f"the study in {str(d)!r} is not finished: its selection is not final. Fix: `dptune resume "
                          f"{d}`, then export.")  # fmt: skip
    names = [a.arm for a in plan.arms]
    if arm is not None and arm not in names:
        raise ConfigError(f"no arm {arm!r} in this study. Fix: --arm one of {', '.join(names)}.")
    table = {r["arm"]: r for r in results.study_table(d)}
    by_id = {r["run_id"]: r for r in rows}
    hidden_k = any(hides_run_count(a.guarantee.get("kind")) for a in plan.arms)
    digest = study_ledger_digest(d)
    written = []
    for a in [a for a in plan.arms if arm in (None, a.arm)]:
        row = table[a.arm]
        # The run whose weights the arm publishes: the first selected run (procedure / seed replicate 0's
        # pick; one model per arm — publishing one per replicate would compose).
        selected = row.get("selected_runs") or []
        rid = min(selected, key=lambda r: (plan.runs[r].replicate, plan.runs[r].procedure), default=None)
        ckpt = load_checkpoint(d, rid) if rid is not None else None
        if ckpt is None or rid is None:  # "or rid is None" for the type checker: ckpt is None then too
            if skip_missing or (arm is None and rid is None):  # every arm: skip one with no selection
                continue
            why = (
                "no run was selected (every run diverged or failed)"
                if rid is None
                else "the selected run's weights are not stored (a study run before dptune saved checkpoints, "
                "or checkpoints/ was deleted)"
            )
            raise ConfigError(f"arm {a.arm!r}: {why}; retraining would be a new release. Fix: run a new study.")
        ledger: dict[str, Any] = {"digest": digest, "scope": "the whole study (every private arm, every run)"}
        if hidden_k:
            # The ledger is a function of the number of runs drawn: its digest would let anyone test guesses of K.
            ledger = {
                "digest": None,
                "note": "withheld: the study has an arm that keeps the number of runs "
                "secret and the ledger's digest would reveal it; it is in diagnostics/models/.",
            }
            diag = diagnostics_dir(base) / MODELS_DIR / a.arm  # with the folder's README.txt (its label)
            save_text(diag / "ledger_digest.json", json.dumps(labelled_json({"digest": digest}), indent=2))
        card = _card(cfg, a, row, plan.runs[rid], by_id[rid], ckpt, ledger)
        if whole := results.release_note(plan):
            card["guarantee"]["release_folder"] = whole
        if math.isfinite(row["planned_epsilon"]):
            written.append(write_model(release_dir(base) / MODELS_DIR / a.arm, ckpt["state_dict"], card))
        else:
            # A non-private arm (nodp): no guarantee covers its weights, never in release/; the owner's copy, labelled.
            card = labelled_json(card)
            written.append(write_model(diagnostics_dir(base) / MODELS_DIR / a.arm, ckpt["state_dict"], card))
    return written


def _card(
    cfg: Mapping[str, Any],
    a: ArmPlan,
    row: Mapping[str, Any],
    run: RunSpec,
    stored: Mapping[str, Any],
    ckpt: Mapping[str, Any],
    ledger: dict[str, Any],
) -> dict[str, Any]:
    """The model card of arm ``a``'s selected run (``row``: its ``study_table`` row)."""
    sel = cfg.get("selection", {})
    guarantee = {
        "epsilon": row["planned_epsilon"],
        "delta": row["planned_delta"],
        "accountant": row["accountant"],
        "per": row["guarantee_per"],
        "kind": a.guarantee.get("kind"),
        "method": row["method"],
        "selection": f"{sel.get('mode', 'public')} selection on the {sel.get('split', 'test')} split "
        f"({row['metric']}, checkpoint rule: {sel.get('checkpoint', 'best')}, across seeds: "
        f"{sel.get('across_seeds', 'per-seed')})",
        "covered": list(COVERED) if math.isfinite(row["planned_epsilon"]) else [],
        "not_covered": list(NOT_COVERED),
        **({"epsilon_float_slack": row["epsilon_float_slack"]} if "epsilon_float_slack" in row else {}),
    }
    if sel.get("across_seeds") == "mean" and row["guarantee_per"] == "seed replicate":
        # The weights are the run chosen on every replicate's scores: only the composition of all the replicates'
        # runs covers them, and the configuration they reveal (found in review: the card stated one replicate's ε).
        seeds = len(cfg.get("study", {}).get("seeds", []))
        guarantee.update(epsilon=row["selection_epsilon"], per="study")
        guarantee["selection"] += (f"; ε: all {seeds} seed replicates' runs composed, as the selection averaged their "
                                   "scores while account_seeds = false")  # fmt: skip
    # Not the in-memory tensors' fingerprint: a hash of the private training set allows membership tests (owner's).
    data = dict(cfg.get("data") or {})
    if "python_tensors" in data:
        data["python_tensors"] = "in-memory tensors (not identified: their hash would reveal the data)"
    return {
        # the guarantee's ε: an oracle arm's target ε is per run, not its model's (found in review)
        "title": f"{a.label} at ε = {up(guarantee['epsilon'], 4)} ({cfg.get('study', {}).get('name', 'study')})",
        "dptune_version": __version__,
        "arm": a.arm,
        "guarantee": guarantee,
        "configuration": {
            "strategy": a.strategy,
            "hyperparameters": json.loads(stored["config"]) if isinstance(stored["config"], str) else stored["config"],
            "noise_multiplier": run.noise_multiplier,
            "sampling_rate": run.sampling_rate,
            "steps": run.steps,
            "seed_replicate": run.replicate,
        },
        "checkpoint": {"rule": sel.get("checkpoint", "best"), "step": stored["best_step"]},
        "evaluation": {
            "metric": row["metric"],
            "selection_score": stored["score"],
            "test_metric": stored["test_metric"],
        },
        "model": ckpt.get("model") or {},
        "data": data,
        **randomness_statement(bool(cfg.get("study", {}).get("secure"))),
        "ledger": ledger,
    }


def prune_checkpoints(study_dir: str | Path) -> int:
    """Delete the checkpoints of runs no arm selected (a finished study); return how many."""
    d = Path(study_dir)
    keep = {checkpoint_path(d, rid).name for r in results.study_table(d) for rid in r["selected_runs"]}
    folder = d / CHECKPOINTS_DIR  # glob finds nothing in a missing folder
    stale = [f for f in folder.glob("*.pt") if f.name not in keep]
    for f in [*stale, *folder.glob(".*.tmp-*")]:  # and temporary files a process killed mid-write left (no final name)
        f.unlink()
    return len(stale)
