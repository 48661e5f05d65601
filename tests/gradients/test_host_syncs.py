"""Host syncs of the GPU fast path, counted on the CPU (issue 25: "at most 2 host reads a step").

A CUDA graph refuses any operation that reads the device from the host (``.item()``, ``nonzero``,
``unique``, ``bincount``, a boolean index, ...) or copies Python data to it; outside a graph each
such read stalls the GPU's queue. Both are visible on the CPU as ATen operations, so a dispatch
mode lists them:

* the captured region (``graphed``: forward, backward, layer rules, norms; the weighted sum) has
  none, for the models the GPU benchmarks run and every Hugging Face family the ghost path covers,
  with eager and SDPA attention, on the float64 Gram path of A100/H100/H200/B200 (``fast_fp64``);
* each strategy's whole step makes the pinned number of reads (``READS``): a new read shows here
  before it costs the GPU.
"""

from __future__ import annotations

import math
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dptune
from dptune import models
from dptune.gradients import graphed, norm_bounds
from dptune.gradients.oracle import GradientOracle
from dptune.strategies import STRATEGIES

_SYNCS = {"_local_scalar_dense", "nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount",
          "masked_select", "equal", "is_nonzero", "histc"}  # fmt: skip


class HostSyncs(TorchDispatchMode):
    """Counts the operations that read a CUDA device from the host, by op and dptune/transformers line."""

    dptune_rowwise = True  # it only counts: dptune's private passes accept it (``isolation.check_modes``)

    def __init__(self, copies: bool = True) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.copies = copies  # count Python data made a tensor (off where host tensors are meant: indices)

    def __enter__(self) -> HostSyncs:
        # Reads that do not dispatch an ATen operation on the host: a copy to the host (on a GPU, a read).
        self._saved = {m: getattr(torch.Tensor, m) for m in ("tolist", "cpu")}  # .numpy() needs a host tensor
        for m, f in self._saved.items():
            setattr(torch.Tensor, m, self._counted(m, f))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for m, f in self._saved.items():
            setattr(torch.Tensor, m, f)
        super().__exit__(*exc)

    def _counted(self, name: str, f):  # type: ignore[no-untyped-def]
        def read(t: torch.Tensor, *a, **k):  # type: ignore[no-untyped-def]
            self.counts[f"{name} @ {_where()}"] += 1
            return f(t, *a, **k)

        read.dptune_rowwise = True  # type: ignore[attr-defined]  # it only counts (``isolation.trusted_code``)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if (
            name in _SYNCS
            or (name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None)
            or (name.startswith("index") and len(args) > 1 and _bool_index(args[1]))
            or (
                name == "lift_fresh" and self.copies and out.numel() > 0
            )  # torch.tensor(data, device=...): a host-to-device copy
        ):
            self.counts[f"{name} @ {_where()}"] += 1
        return out


def _bool_index(indices: object) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices
    )


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/dptune/" in f.filename or "/transformers/" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def test_the_detector_sees_a_host_read_and_a_boolean_index() -> None:
    x = torch.randn(8)
    with HostSyncs() as mode:
        _ = x[x > 0]
        _ = float(x.sum())
        _ = torch.bincount(torch.tensor([1, 2]))
        _ = x * 2 + x.abs().max()  # device-side only
    assert {k.split(" @ ")[0] for k in mode.counts} == {"index", "_local_scalar_dense", "bincount", "lift_fresh"}


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[HostSyncs]:
    """``graphed.capture`` on the CPU, each captured function run once under a ``HostSyncs`` mode and with
    ``torch.cuda.is_current_stream_capturing()`` true, as libraries see it inside a real capture."""
    modes: list[HostSyncs] = []

    def capture(fn, pool):  # type: ignore[no-untyped-def]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            with HostSyncs() as mode:
                fn()
        modes.append(mode)
        return fn

    monkeypatch.setattr(graphed, "capture", capture)
    monkeypatch.setattr(graphed, "MAX_PADDING", math.inf)  # batches of 5-6: captured all the same
    monkeypatch.setattr(norm_bounds, "fast_fp64", lambda device: True)
    return modes


def _capture(model: nn.Module, x: object, y: torch.Tensor, modes: list[HostSyncs]) -> Counter[str]:
    oracle = GradientOracle(model, "cross_entropy", method="ghost")
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    oracle(params, x, y)  # the first call: the isolation probe, eagerly (as in a run)
    got = graphed.Graphs(oracle._run_ghost, model)(params, x, y)
    assert got is not None and len(modes) == 2, "both graphs captured"
    got.weighted_sum(torch.rand(y.shape[0]))
    return modes[0].counts + modes[1].counts


@pytest.mark.parametrize("name", ["mlp", "galli_cnn"])
def test_the_captured_region_reads_nothing_from_the_device(name: str, captured: list[HostSyncs]) -> None:
    torch.manual_seed(0)
    model = models.build(name)
    x = torch.rand(6, 1, 28, 28)
    assert _capture(model, x, torch.randint(0, 10, (6,)), captured) == Counter()


_FAMILIES = ["bert", "roberta", "distilbert", "gpt2", "llama"]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", _FAMILIES)
def test_hugging_face_families_capture_without_host_reads(
    family: str, attention: str, captured: list[HostSyncs]
) -> None:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_ghost_transformers import Pooled, _batch

    torch.manual_seed(1)
    model = Pooled(family)
    model.enc.config._attn_implementation = attention
    model.train()  # dropout on: its masks come from the device generator
    x, y = _batch()
    assert _capture(model, x, y, captured) == Counter()


# Host reads per step, replay path on (fast_fp64); the batch's indices are made on the host and queued
# to the device through pinned memory (``inputs.indices_to``), not a read. Every step: the replay's
# non-finite check and the loop's one read of (parameters finite, train loss), which also brings OSO's
# sign-rule statistics (C: the projection of q̃, ρ: g̃_t·g̃_{t−1}) and quantile's released count
# (``hypergradient.later``); ADADP reads its extrapolation error every other (half) step; DP-ZO its
# differences and released scalar, and the loop only the finite flag (no per-example losses), as nodp.
READS = {"dpsgd": 2, "dpadam": 2, "adamwosm": 2, "dpgd": 2, "quantile": 2, "oso": 2, "adadp": 2.5, "dpzo": 3,
         "nodp": 1}  # fmt: skip


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_host_reads_per_step_are_pinned(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphed, "replayable", lambda device: True)
    monkeypatch.setattr(graphed, "MAX_PADDING", math.inf)  # a small batch, replayed all the same
    monkeypatch.setattr(norm_bounds, "fast_fp64", lambda device: True)
    monkeypatch.setattr(GradientOracle, "_gap", lambda self: 10**6)  # the first probe only (later ones: random calls)
    torch.manual_seed(0)
    x, y = torch.randn(240, 6), torch.randint(0, 3, (240,))
    private = STRATEGIES[name]().private
    kw = {"seed": 3, "noise_multiplier": 1.0 if private else None, "grad_method": "ghost"}
    kw.update({"full_batch": True} if name == "dpgd" else {"expected_batch_size": 48})
    counts = []
    for steps in (4, 12):  # the difference: steady-state steps only (no probe, no set-up)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        with HostSyncs(copies=False) as mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # few steps: the sampling advice
            dptune.train(model, (x, y), name, steps=steps, **kw)
        counts.append(mode.counts)
    per_step = {k: (counts[1][k] - counts[0][k]) / 8 for k in counts[1] if counts[1][k] != counts[0][k]}
    assert sum(per_step.values()) == READS[name], per_step


def test_stacked_trials_read_once_per_trial_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``train_many``'s K stacked trials: the non-finite verdicts of all K in one read, then all K loop
    reads (train loss, parameters finite) in one: 2 a step (was 2K, then K + 1)."""
    from dptune import vectorized

    x, y = torch.rand(300, 1, 28, 28), torch.randint(0, 10, (300,))
    counts = []
    for steps in (3, 7):
        with HostSyncs(copies=False) as mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            vectorized.train_many(lambda k: models.build("mlp"), (x, y), "dpsgd", seeds=[0, 1, 2], steps=steps,
                                  noise_multiplier=1.0, expected_batch_size=32, fallback="error")  # fmt: skip
        counts.append(mode.counts)
    per_step = {k: (counts[1][k] - counts[0][k]) / 4 for k in counts[1] if counts[1][k] != counts[0][k]}
    assert sum(per_step.values()) == 2, per_step


@pytest.mark.parametrize("name, config", [("oso", {}), ("oso", {"rule": "normalized"}), ("oso", {"rule": "additive"}),
                                          ("quantile", {})])  # fmt: skip
def test_reads_deferred_to_the_loop_change_nothing(name: str, config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sign rules' statistics read with the loop's read (``hypergradient.later``) give the run that
    reading them at once gives: the same history (C, ρ, g_dot_q, ...) and parameters, bit for bit."""
    import contextlib
    import importlib

    train_module = importlib.import_module("dptune.train")  # the module (``dptune.train`` is also the function)
    torch.manual_seed(0)
    x, y = torch.randn(240, 6), torch.randint(0, 3, (240,))
    runs = []
    for defer in (True, False):
        if not defer:  # no collector: ``later`` reads at once, as a strategy stepped by hand
            monkeypatch.setattr(train_module, "collecting", lambda: contextlib.nullcontext([]))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs.append(dptune.train(model, (x, y), dptune.make_strategy(name, **config), steps=12, seed=3,
                                     noise_multiplier=1.0, expected_batch_size=48, grad_method="ghost"))  # fmt: skip
    deferred, eager = runs
    assert deferred.history == eager.history
    assert len({row["clip"] for row in deferred.history}) > 1  # the rule moved C: the statistics were used
    for k, v in deferred.final_params.items():
        assert torch.equal(v, eager.final_params[k]), k
