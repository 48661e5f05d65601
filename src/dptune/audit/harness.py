"""Gradient canaries (Dirac canaries on the linear audit loss), a spy on the noise gateway, and membership scores;
everything else is the real code path. Model and statistics: docs/reliability.md, "Privacy audits"."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from dptune.release.mechanisms import DeferredSum, NoisyRelease, SumQuery

CANARY_NORM_FACTOR = 1e4  # M = factor × (largest clipping threshold the run may use)


# ----------------------------------------------------------------------------- model and data
def linear_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ℓ(θ; x) = θᵀx per example over the last axis ([B, 1] → [B], [1] → scalar): the gradient is x."""
    return out.sum(-1)


def audit_model(dim: int) -> nn.Module:
    model = nn.Linear(dim, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


class LinearLossUnderMSE(nn.Module):
    """The linear audit loss under loss='mse': sqrt(θᵀx + K) against 0 is θᵀx up to the constant K."""

    OFFSET = 1e9  # K

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x @ self.weight.T + self.OFFSET)


@dataclass(frozen=True)
class CanaryData:
    """Training inputs: canaries (x = M·e_j on coordinate ``offset + j``) and background rows."""

    x: torch.Tensor  # [n, d]
    y: torch.Tensor  # [n] (unused by the linear loss)
    dim: int
    canary_coords: np.ndarray  # coordinates observed by the auditor (one per canary / trial)
    canary_norm: float


def make_data(present: np.ndarray, background: int, background_dim: int, canary_norm: float, seed: int) -> CanaryData:
    """Rows for the canaries with ``present[j]`` true, plus ``background`` rows of Gaussian directions with
    log-normal norms (coordinates < background_dim); canary j owns coordinate ``background_dim + j``."""
    rng = np.random.default_rng(seed)
    m = int(present.shape[0])
    dim = background_dim + m
    present_idx = np.flatnonzero(present)
    n = background + present_idx.size
    x = np.zeros((n, dim), dtype=np.float32)
    if background:
        g = rng.normal(size=(background, background_dim))
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        g *= rng.lognormal(mean=0.0, sigma=0.5, size=(background, 1))
        x[:background, :background_dim] = g
    x[background + np.arange(present_idx.size), background_dim + present_idx] = canary_norm
    # Shuffle rows so canaries are not a contiguous block (Poisson sampling ignores order anyway).
    perm = rng.permutation(n)
    coords = background_dim + np.arange(m)
    return CanaryData(torch.from_numpy(x[perm]), torch.zeros(n, dtype=torch.long), dim, coords, float(canary_norm))


# ----------------------------------------------------------------------------- the spy
@dataclass
class QueryRecord:
    name: str
    noise_multiplier: float
    sensitivity: float
    values: np.ndarray | None  # noisy output at the watched coordinates (None for scalar queries)


@dataclass
class ReleaseRecord:
    label: str
    sampling_rate: float
    run: str
    queries: list[QueryRecord]


@dataclass
class ReleaseRecorder:
    """Keeps the noisy outputs of every release at the watched coordinates (white-box view)."""

    coords: np.ndarray
    records: list[ReleaseRecord] = field(default_factory=list)

    def observe(self, gateway: NoisyRelease, queries: tuple[SumQuery, ...], outputs: list, label: str) -> None:
        idx = torch.as_tensor(self.coords, dtype=torch.long)
        qs = []
        for q, out in zip(queries, outputs, strict=True):
            if isinstance(out, dict):
                flat = torch.cat([v.detach().reshape(-1).double().cpu() for v in out.values()])
                vals = flat[idx].numpy().copy()
            else:
                vals = None  # a scalar statistic (e.g. the quantile count) is shared by all canaries
            qs.append(QueryRecord(q.name, float(q.noise_multiplier), float(q.sensitivity), vals))
        self.records.append(ReleaseRecord(label, float(gateway.sampling_rate), gateway.run, qs))

    def query_names(self) -> list[str]:
        """The vector queries released, in order of first release."""
        return list(dict.fromkeys(q.name for r in self.records for q in r.queries if q.values is not None))

    def llr_score(self, names: set[str] | None = None) -> np.ndarray:
        """Σ_t log(1 − q + q·exp(Λ_t)) per watched coordinate, over queries in ``names`` (all: None)."""
        total = np.zeros(self.coords.shape[0])
        for r in self.records:
            terms = [
                (q.values / q.sensitivity - 0.5) / q.noise_multiplier**2
                for q in r.queries
                if q.values is not None and (names is None or q.name in names)
            ]
            if not terms:
                continue
            lam = sum(terms, np.zeros_like(total))
            if r.sampling_rate >= 1.0:
                total += lam
            else:
                total += np.logaddexp(math.log1p(-r.sampling_rate), math.log(r.sampling_rate) + lam)
        return total


@contextlib.contextmanager
def spy_on_releases(recorder: ReleaseRecorder) -> Iterator[ReleaseRecorder]:
    """Patch ``NoisyRelease.release`` (the class attribute: every gateway) to feed ``recorder``; restored on exit."""
    previous = NoisyRelease.__dict__["release"]

    def release(self: NoisyRelease, *queries: SumQuery, label: str):
        outputs = previous(self, *queries, label=label)
        # A deferred query (OSO's q̃) is observed as the full noisy vector that the ledger
        # accounts for; the handle keeps that draw, so the strategy's projection uses it.
        seen = [self.materialize(o) if isinstance(o, DeferredSum) else o for o in outputs]
        recorder.observe(self, queries, seen, label)
        return outputs

    NoisyRelease.release = release  # type: ignore[method-assign]
    try:
        yield recorder
    finally:
        NoisyRelease.release = previous  # type: ignore[method-assign]


def loss_scores(final_params: dict[str, torch.Tensor], data: CanaryData) -> np.ndarray:
    """Black-box score −ℓ(θ_final; canary_j) = −M·θ_final[coord_j] for every canary j."""
    w = torch.cat([v.detach().reshape(-1).double().cpu() for v in final_params.values()]).numpy()
    return -data.canary_norm * w[data.canary_coords]
