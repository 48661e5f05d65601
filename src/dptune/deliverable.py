"""The selected model's weights and card (save_trained, tune.export), load_model; see docs/privacy.md, "Your model"."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptune import models
from dptune._version import __version__
from dptune.errors import ConfigError
from dptune.factories import call_factory, import_factory
from dptune.outputs import labelled_json, randomness_statement, strict_json, up
from dptune.own import factory_kwargs

CHECKPOINTS_DIR = "checkpoints"
MODELS_DIR = "models"
WEIGHTS_FILE = "model.pt"
CARD_JSON = "model_card.json"
CARD_MD = "model_card.md"
CARD_FORMAT = "dptune-model-card/1"
PRIVACY_DOC = "docs/privacy.md, section 'Your model and data'"

COVERED = (
    "the weights in model.pt: post-processing of the noisy releases recorded in the ledger",
    "the selected configuration and checkpoint step, and this card",
)
NOT_COVERED = (
    "the seed in seeded mode: it is a secret key (whoever knows it can regenerate the noise and the batches)",
    "the evaluation / selection data in public selection mode: treated as public, not protected",
    "the other candidates' weights and the owner-only files (checkpoints/, diagnostics/): never publish them",
    "anything outside dptune: data preprocessing fitted on the private data, side channels such as run time",
    "the number of classes where it was read from your data's labels (the largest + 1: your data factory or "
    "tensors, a CSV without declared labels): not differentially private: for the data owner only; declare it",
)


# ----------------------------------------------------------------------------- files
def _atomic(path: Path, write: Any) -> Path:
    """Write through a temporary file then ``os.replace``: a crash never leaves half a file under the name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def save_state_dict(state: Mapping[str, torch.Tensor], path: str | Path) -> Path:
    """``torch.save`` of a CPU state dict, atomically."""
    cpu = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    return _atomic(Path(path), lambda fh: torch.save(cpu, fh))


def save_text(path: Path, text: str) -> Path:
    """A UTF-8 text file, atomically (``_atomic``)."""
    return _atomic(path, lambda fh: fh.write(text.encode("utf-8")))


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def full_state(model: nn.Module, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict (buffers included) with ``params`` in place, on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in {**model.state_dict(), **params}.items()}


# ----------------------------------------------------------------------------- the card
def write_model(
    directory: str | Path, state: Mapping[str, torch.Tensor], card: Mapping[str, Any], *, load_as: str | None = None
) -> Path:
    """Write model.pt, model_card.json (the weights' SHA-256, code loading ``load_as``) and model_card.md; return it."""
    d = Path(directory)
    weights = save_state_dict(state, d / WEIGHTS_FILE)
    weights_id = {"file": WEIGHTS_FILE, "format": "torch.save(state_dict)", "sha256": file_sha256(weights)}
    full = {"format": CARD_FORMAT, **card, "weights": weights_id}
    full["load"] = reload_code(load_as or d.name, full.get("model", {}))
    save_text(d / CARD_JSON, strict_json(full, indent=2) + "\n")
    save_text(d / CARD_MD, card_markdown(full))
    return d


def reload_code(folder: str, ident: Mapping[str, Any]) -> str:
    """The card's load code: a built-in from the card, yours via ``model=`` (never ``trust_factory``: editable)."""
    if "name" in ident:
        return f"import dptune\nmodel, card = dptune.load_model({folder!r})"
    path, args = ident.get("factory") or ident.get("builder") or ident.get("class") or "", ident.get("kwargs")
    if "factory" in ident:
        mod, _, attr = path.partition(":")
    else:  # "module.qualname": the longest prefix that is a loaded module
        parts = path.split(".")
        k = next((k for k in range(len(parts) - 1, 0, -1) if ".".join(parts[:k]) in sys.modules), len(parts) - 1)
        mod, attr = ".".join(parts[:k]), ".".join(parts[k:])
    args = ident.get("options") if args is None else args
    call = f"{attr}({', '.join(f'{k}={v!r}' for k, v in (args or {}).items())})"
    head = "import dptune\n" + ("" if mod in ("", "__main__") else f"from {mod} import {attr.split('.')[0]}\n")
    note = "" if args is not None else "  # your class, built as for training"
    return f"{head}model, card = dptune.load_model({folder!r}, model={call}){note}"


def _fmt(x: Any) -> str:  # a stated ε or δ: rounded up, never read smaller than the ledger's (found in review)
    return up(x, 6) if isinstance(x, float) else "—" if x is None else str(x)


def card_markdown(card: Mapping[str, Any]) -> str:
    g, led, w = card.get("guarantee", {}), card.get("ledger", {}), card.get("weights", {})
    lines = [
        f"# Model card: {card.get('title', 'dptune model')}", "",
        f"dptune {card.get('dptune_version')} · randomness: {card.get('randomness')}", "",
        *([f"**{card['privacy']}**", ""] if card.get("privacy") else []),
        "## Guarantee", "",
        f"({_fmt(g.get('epsilon'))}, {_fmt(g.get('delta'))})-differential privacy "
        f"(accountant: {g.get('accountant')}, per {g.get('per', 'run')}, add/remove one example).", "",
        *[f"- epsilon_float_slack: {_fmt(x)} (added to ε)\n" for x in [g.get("epsilon_float_slack")] if x is not None],
        f"- selection: {g.get('selection')}", "", *([f"- {g['release_folder']}", ""] if g.get("release_folder") else []),
        "Covered by the guarantee:", "", *[f"- {c}" for c in g.get("covered", [])], "",
        "Not covered:", "", *[f"- {c}" for c in g.get("not_covered", [])], "",
        f"Details: {PRIVACY_DOC}.", "", "## Randomness", "", str(card.get("randomness_note", "")), "",
        "## Configuration", "", "```json", json.dumps(card.get("configuration", {}), indent=2, default=str), "```", "",
        "## Model and data", "",
        f"- model: `{json.dumps(card.get('model'), default=str)}`",
        f"- data: `{json.dumps(card.get('data'), default=str)}`", "",
    ]  # fmt: skip
    if card.get("evaluation"):
        lines += ["## Evaluation", "", "```json", json.dumps(card["evaluation"], indent=2, default=str), "```", ""]
    lines += [
        "## Ledger", "", f"- digest (SHA-256): `{led.get('digest')}`", *[f"- {n}" for n in (led.get("note"),) if n], "",
        "## Weights", "", f"- `{w.get('file')}` ({w.get('format')}), SHA-256 `{w.get('sha256')}`", "",
        "```python", str(card.get("load", "")), "```", "",
    ]  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------- dptune.train
def save_trained(
    result: Any,
    directory: str | Path,
    *,
    model_id: Mapping[str, Any] | None = None,
    data_id: Mapping[str, Any] | None = None,
) -> Path:
    """A ``TrainResult``'s selected checkpoint and card into ``directory`` (``model_id``: how to rebuild it)."""
    if result.model is None:
        raise ConfigError("this result carries no model to save")
    params = result.best_params if (best := result.best_params is not None) else result.final_params
    if not all(bool(torch.isfinite(v).all()) for v in params.values() if v.is_floating_point()):
        raise ConfigError("the run diverged: its parameters are not finite, so there is no model to save (found in "
                          "review: a NaN model was saved). Fix: a smaller learning rate, or a smaller clip.")  # fmt: skip
    state = full_state(result.model, params)
    plan, cls = result.plan, type(result.model)
    private = bool(plan.strategy.private)
    eps = (result.epsilon() if result.delta else None) if private else math.inf
    taken = plan.steps if result.steps_taken is None else result.steps_taken  # a user loop may stop early
    card = {
        "title": f"{plan.strategy.name} (dptune.train)",
        "dptune_version": __version__,
        "guarantee": {
            "epsilon": eps,
            "delta": result.delta,
            "accountant": plan.accountant,
            "per": "run",
            "selection": "the checkpoint with the best metric on the evaluation data, declared public (not protected)"
            if best
            else "final parameters: the evaluation data was not declared public, so no checkpoint was selected on "
            "it and its metrics are withheld (they are not differentially private)"
            if result.evals and not result.eval_public
            else "final parameters (no selection)",
            "covered": list(COVERED) if private else [],
            "not_covered": list(NOT_COVERED) if private else ["everything: a non-private strategy (ε = ∞)"],
            **({"epsilon_float_slack": result.float_slack} if result.secure_mode else {}),  # as in the release JSON
        },
        "configuration": {
            "strategy": plan.strategy.config(),
            "noise_multiplier": plan.noise_multiplier,
            "sampling_rate": plan.sampling_rate,
            "expected_batch_size": plan.expected_batch_size,
            "steps": plan.steps,
            "steps_taken": taken,
            "n": plan.n,
            **({"defaults": "fine-tuning: pretrained model"} if plan.pretrained else {}),
        },
        "checkpoint": {"rule": "best" if best else "final", "step": result.best_step if best else taken},
        "evaluation_data": ("declared public" if result.eval_public else "private") if result.evals else None,
        "evaluation": {"metric": result.metric, "best": result.best_metric} if best else {},
        "model": dict(model_id) if model_id else {"class": f"{cls.__module__}.{cls.__qualname__}"},
        "data": dict(data_id) if data_id else {"name": "in-memory (not identified)"},
        **randomness_statement(result.secure_mode),
        "ledger": {"digest": result.ledger.digest(), "releases": result.ledger.releases},
    }
    if not private:  # weights trained without privacy may memorise examples: the owner's only
        card = labelled_json(card)
    d = Path(directory)  # a path out of the working folder (`..`, absolute) would name the owner's folders
    return write_model(d, state, card, load_as=None if d.is_absolute() or ".." in d.parts else str(d))


# ----------------------------------------------------------------------------- a study's checkpoints
def checkpoint_path(study_dir: str | Path, run_id: str) -> Path:
    """``<study>/checkpoints/<run id made file-safe>-<hash>.pt`` (owner only)."""
    safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", run_id)[:80]
    tag = hashlib.sha256(run_id.encode()).hexdigest()[:10]
    return Path(study_dir) / CHECKPOINTS_DIR / f"{safe}-{tag}.pt"


_CKPT_README = """NOT DIFFERENTIALLY PRIVATE: FOR THE DATA OWNER ONLY.

The selected checkpoint of each run of the study, kept so that the selected model can be
exported without retraining. A candidate that was not selected is not covered by the
guarantee of Liu-Talwar / repeat-and-select arms, and publishing several candidates composes
their privacy costs. Publish only release/models/ (see docs/privacy.md).
"""


def save_checkpoint(study_dir: str | Path, run_id: str, payload: Mapping[str, Any]) -> Path:
    """The coordinator's write of one run's selected checkpoint (``{"state_dict", "model"}``)."""
    path = checkpoint_path(study_dir, run_id)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)  # owner only
        (path.parent / "README.txt").write_text(_CKPT_README, encoding="utf-8")
    obj = {
        "run_id": run_id,
        "model": dict(payload.get("model") or {}),
        "state_dict": {k: v.detach().cpu().contiguous() for k, v in payload["state_dict"].items()},
    }
    return _atomic(path, lambda fh: torch.save(obj, fh))


def load_checkpoint(study_dir: str | Path, run_id: str) -> dict[str, Any] | None:
    path = checkpoint_path(study_dir, run_id)
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None


def model_identity(spec: Any, data: Any) -> dict[str, Any]:
    """How ``tune.data.build_model`` built the model: a built-in with its kwargs, or the user's builder."""
    dims = (math.prod(data.input_shape), data.num_classes)
    if getattr(spec, "name", None) is not None:
        return {"name": spec.name, "kwargs": factory_kwargs(models.MODELS[spec.name], *dims, spec.options)}
    if getattr(spec, "factory", None) is not None:
        fn = import_factory(spec.factory, "model factory")
        return {"factory": spec.factory, "kwargs": factory_kwargs(fn, *dims, spec.options)}
    return {**spec.describe(), "options": dict(spec.options)}


# ----------------------------------------------------------------------------- loading
def load_model(
    path: str | Path, model: nn.Module | None = None, *, trust_factory: bool = False
) -> tuple[nn.Module, dict[str, Any]]:
    """``(module, card)`` of a saved folder, SHA-256 checked; yours as ``model=``; a factory if ``trust_factory``."""
    d = p.parent if (p := Path(path)).is_file() else p
    weights, card_path = (p if p.is_file() else d / WEIGHTS_FILE), d / CARD_JSON
    if not weights.is_file():
        raise ConfigError(
            f"no {WEIGHTS_FILE} in {str(d)!r}. Fix: pass the folder written by "
            "`dptune train --save DIR` or `dptune export`."
        )
    card: dict[str, Any] = json.loads(card_path.read_text(encoding="utf-8")) if card_path.is_file() else {}
    if (expected := card.get("weights", {}).get("sha256")) and file_sha256(weights) != expected:
        raise ConfigError(
            f"{str(weights)!r} does not match the SHA-256 in its model card: the weights were "
            "changed after export. Fix: export them again."
        )
    if model is None:
        ident = card.get("model", {})
        if "name" in ident:
            model = models.build(ident["name"], **ident.get("kwargs", {}))
        elif "factory" in ident and trust_factory:  # your module:factory, named by the card
            fn = import_factory(ident["factory"], "model factory")
            model = call_factory(fn, ident["factory"], "model factory", **ident.get("kwargs", {}))
        else:
            trust = "\n(or trust_factory=True: runs the factory this card names; only for a card you trust)"
            raise ConfigError(
                f"this model was built by your code ({ident or 'unknown'}): build it and pass it as "
                f"model=, as the model card shows:\n{reload_code(d.name, ident)}" + trust * ("factory" in ident)
            )
    state = torch.load(weights, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ConfigError(
            f"the weights do not fit the given model ({str(exc).splitlines()[0]}). Fix: pass an "
            "instance of the architecture that was trained."
        ) from None
    return model, card
