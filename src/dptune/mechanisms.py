"""The single place where noise is added to private statistics.

``NoisyRelease.release`` takes one or more *sum queries* computed on the same
Poisson-sampled batch, records their joint ``DpEvent`` in the ledger, and only then
draws and adds the Gaussian noise. No other module adds privacy noise; a test
greps the source tree to keep it that way.

Accounting of a joint release: query i has L2 sensitivity s_i (add/remove one
example) and noise std σ_i = ν_i·s_i; the tuple is one Gaussian mechanism of
multiplier ν = (Σ ν_i⁻²)^(-1/2) (see ``accounting.joint_noise_multiplier``). The event
is ``PoissonSampledDpEvent(q, GaussianDpEvent(ν))``, or a plain Gaussian at q = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dptune import accounting
from dptune.ledger import Ledger

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SumQuery:
    """A sum over the sampled examples, to be released with Gaussian noise.

    ``value`` is a tensor or a dict of tensors (e.g. a gradient per parameter);
    ``sensitivity`` is the L2 sensitivity of the whole value under add/remove of one
    example; the noise std is ``noise_multiplier * sensitivity``.
    """

    name: str
    value: torch.Tensor | Tensors
    sensitivity: float
    noise_multiplier: float

    @property
    def std(self) -> float:
        return self.noise_multiplier * self.sensitivity


class NoiseSource:
    """Gaussian noise from a seeded torch generator, or a CSPRNG-seeded one in secure mode.

    Secure mode re-seeds the generator from ``os.urandom`` (via ``torch.seed``-like
    entropy) and so gives up run-to-run reproducibility. It does *not* fix the
    floating-point weaknesses of sampling N(0, σ²) in floats (see docs/privacy.md).
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu", secure: bool = False):
        self.device = torch.device(device)
        self.secure = secure
        self.generator = torch.Generator(device=self.device)
        if secure:
            import secrets

            self.generator.manual_seed(secrets.randbits(63))
        else:
            self.generator.manual_seed(int(seed))

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        if self.secure:
            return _secure_normal(like, std)
        noise = torch.randn(like.shape, generator=self.generator, device=like.device, dtype=like.dtype)
        return noise.mul_(std)

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def _secure_normal(like: torch.Tensor, std: float) -> torch.Tensor:
    """N(0, std²) from the OS CSPRNG: float64 Box–Muller on 53-bit uniforms, then cast.

    torch's float32 CPU sampler uses 24-bit uniforms, which truncates the tails near 5.8σ
    (an extra δ of about T·q·1e-6 at ν = 1); 53-bit uniforms push the cut-off past 38σ.
    Floating-point rounding of the *sum* is still not hardened (see docs/privacy.md).
    """
    import os

    import numpy as np

    n = like.numel()
    k = (n + 1) // 2
    raw = np.frombuffer(os.urandom(16 * k), dtype=np.uint64).reshape(2, k)
    u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]: log is finite
    u2 = (raw[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2 * math.pi * u2), r * np.sin(2 * math.pi * u2)])[:n]
    return torch.from_numpy(z).reshape(like.shape).to(device=like.device, dtype=like.dtype).mul_(std)


class NoisyRelease:
    """The privacy gateway of one run: every noisy statistic passes through ``release``."""

    def __init__(
        self,
        ledger: Ledger,
        sampling_rate: float,
        noise: NoiseSource,
        run: str = "",
        planned_multiplier: float | None = None,
    ):
        self.ledger = ledger
        self.sampling_rate = accounting.check_sampling_rate(sampling_rate)
        self.noise = noise
        self.run = run
        # Split queries recombine (Σν_i⁻²)^-½ in floating point; the result can differ from
        # the planned ν in the last bits. Within this relative tolerance it IS the planned
        # mechanism, so it is recorded as such (the plan compares events exactly).
        self.planned_multiplier = planned_multiplier

    SNAP_RTOL = 1e-9

    def event_for(self, *noise_multipliers: float):
        nu = accounting.joint_noise_multiplier(noise_multipliers)
        return accounting.gaussian_step_event(nu, self.sampling_rate)

    def release(self, *queries: SumQuery, label: str) -> list[torch.Tensor | Tensors]:
        """Record the joint event, then return each query's value plus N(0, σ_i²) noise."""
        if not queries:
            raise ValueError("release() needs at least one query")
        nu = accounting.joint_noise_multiplier(q.noise_multiplier for q in queries)
        planned = self.planned_multiplier
        if planned is not None and abs(nu - planned) <= self.SNAP_RTOL * planned:
            nu = planned
        if not math.isfinite(nu):
            raise ValueError("a private release needs finite noise; use the 'nodp' strategy for no noise")
        event = accounting.gaussian_step_event(nu, self.sampling_rate)
        comps = tuple((q.name, float(q.noise_multiplier), float(q.sensitivity)) for q in queries)
        # Record first: if the plan refuses, no noise is drawn and nothing is released.
        self.ledger.record(event, label, components=comps, run=self.run)
        out: list[torch.Tensor | Tensors] = []
        for q in queries:
            if isinstance(q.value, dict):
                out.append({k: v + self.noise.normal(v, q.std) for k, v in q.value.items()})
            else:
                out.append(q.value + self.noise.normal(q.value, q.std))
        return out


def record_nonprivate(ledger: Ledger, label: str, run: str = "") -> None:
    """A non-private step (the ``nodp`` baseline) is recorded too: its ε is ∞."""
    from dp_accounting import dp_event

    ledger.record(dp_event.NonPrivateDpEvent(), label, run=run)
