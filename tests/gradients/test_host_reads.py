"""Host reads per training step: each one is a sync on a GPU, which empties the kernel queue.

One run alone on a GPU is only as fast as its host lets it queue kernels, so the training loop
keeps its reads of tensor values to a counted few (docs/performance.md, "One run alone on a
GPU"). Counted on the CPU by wrapping the Tensor methods that read a value back to Python
(``bool``, ``float``, ``int``, ``item``, ``tolist``, ``nonzero``): the same code runs on a GPU,
where a few more operations sync implicitly (boolean-mask indexing), so these are lower bounds
of the GPU's counts (measured there with ``benchmarks/host_syncs.py``).
"""

from __future__ import annotations

import collections
import importlib
import math
import traceback

import pytest
import torch
from torch import nn

import dptune

READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "nonzero")
HP = {"nodp": {"lr": 0.05}, "dpsgd": {"lr": 0.05, "clip": 1.0}, "oso": {"lr": 0.05, "initial_clip": 0.5}}
# Reads a step, steps 2 … T (set-up and the final accounting excluded). nodp: the divergence
# flag and the training loss, read together; DP-SGD: + the per-example non-finite check (once for
# both of OSO's sums); OSO: + the rows of the second query's reuse (one ``nonzero``), the deferred
# q̃'s projection (its noise drawn on the device) and OSORate's g̃·g̃_prev.
LIMIT = {"nodp": 1, "dpsgd": 2, "oso": 5}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _count_reads(
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
    steps: int = 6,
    model: nn.Module | None = None,
    data: tuple = (),
    **kw: object,
) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    counting = [False]

    def wrap(name: str) -> None:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *a: object, **k: object) -> object:
            if counting[0]:
                frame = traceback.extract_stack(limit=2)[0]
                counts[f"{name} {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"] += 1
            return original(self, *a, **k)

        read.dptune_rowwise = True  # type: ignore[attr-defined]  # it only counts (``isolation.trusted_code``)
        monkeypatch.setattr(torch.Tensor, name, read)

    for name in READS:
        wrap(name)
    from dptune.gradients.oracle import GradientOracle

    monkeypatch.setattr(GradientOracle, "_gap", lambda self: 10**6)  # the first probe only (later: at random calls)

    def window(t: int, row: dict[str, object]) -> None:
        counting[0] = 1 <= t < steps  # after step 1's record until step T's: steps 2 … T

    g = torch.Generator().manual_seed(0)
    x, y = data or (torch.randn(512, 1, 8, 8, generator=g), torch.randint(0, 3, (512,), generator=g))
    dptune.train(
        model or _model(),
        (x, y),
        strategy,
        steps=steps,
        expected_batch_size=64,
        noise_multiplier=None if strategy == "nodp" else 1.0,
        device="cpu",
        eval_every=10**9,
        on_step=window,
        **HP[strategy],
        **kw,
    )
    return counts


@pytest.mark.parametrize("strategy", list(LIMIT))
def test_a_training_step_reads_few_tensor_values(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    steps = 6
    counts = _count_reads(monkeypatch, strategy, steps)
    per_step = sum(counts.values()) / (steps - 1)
    assert per_step <= LIMIT[strategy], f"{per_step} reads a step: {dict(counts)}"


def test_a_transformer_step_reads_as_few(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny BERT on the ghost path, 6 tokens: its 12 Linear layers over tokens take the Gram rule
    (T(p + d) < p·d), whose float64 re-check of cancelling examples is decided for all of them by
    one read (``norm_bounds.gram_bound``; before: one ``nonzero`` per layer): DP-SGD's 2 + 1, and
    transformers' own attention-mask check (``masking_utils``, in a non-private step too)."""
    pytest.importorskip("transformers")
    from hf_models import tiny_classifier, token_batch

    model = tiny_classifier("bert")
    counts = _count_reads(monkeypatch, "dpsgd", model=model, data=token_batch(512, 6), grad_method="ghost")
    ours = sum(v for k, v in counts.items() if "masking_utils" not in k)
    assert ours / 5 <= LIMIT["dpsgd"] + 1, dict(counts)
    assert any("norm_bounds" in k for k in counts), dict(counts)  # the Gram rule ran


def test_the_counter_sees_a_per_tensor_divergence_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter is not blind: the per-tensor check the loop used before (one read per
    parameter tensor, 6 here) pushes nodp over its limit."""
    train_module = importlib.import_module("dptune.train")  # the module (dptune.train is also the function)

    def per_tensor(a: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tensor(0.0 if all(bool(torch.isfinite(v).all()) for v in a.values()) else math.nan)

    monkeypatch.setattr(train_module, "sup_norm", per_tensor)
    counts = _count_reads(monkeypatch, "nodp")
    assert sum(counts.values()) / 5 >= 6, dict(counts)
