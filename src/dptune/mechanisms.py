"""The single place where noise is added to private statistics.

``NoisyRelease.release`` takes one or more *sum queries* computed on the same
Poisson-sampled batch, records their joint ``DpEvent`` in the ledger, and only then
draws and adds the Gaussian noise. No other module adds privacy noise; a test
greps the source tree to keep it that way.

Accounting of a joint release: query i has L2 sensitivity s_i (add/remove one
example) and noise std σ_i = ν_i·s_i; the tuple is one Gaussian mechanism of
multiplier ν = (Σ ν_i⁻²)^(-1/2) (see ``accounting.joint_noise_multiplier``). The event
is ``PoissonSampledDpEvent(q, GaussianDpEvent(ν))``, or a plain Gaussian at q = 1.

Deferred noise (``SumQuery(..., deferred=True)``): the event is recorded exactly as for an
ordinary query, but the release returns a ``DeferredSum`` handle instead of value + Z. A
consumer that only ever reads ONE linear statistic ⟨value + Z, v⟩ of the noisy vector (OSO's
exp/additive rules) asks ``NoisyRelease.project`` for it, which draws the scalar
⟨Z, v⟩ ~ N(0, σ²‖v‖²) directly. When v is independent of Z (a function of data and of
randomness other than Z) this is an exact simulation: the
joint law of everything the run outputs is unchanged, so the accounting of the (vector)
release still covers it. One projection per handle: a second one would have to be drawn
jointly with the first. ``NoisyRelease.materialize`` draws the full vector instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from dptune import accounting
from dptune.ledger import Ledger

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SumQuery:
    """A sum over the sampled examples, to be released with Gaussian noise.

    ``value`` is a tensor or a dict of tensors (e.g. a gradient per parameter);
    ``sensitivity`` is the L2 sensitivity of the whole value under add/remove of one
    example; the noise std is ``noise_multiplier * sensitivity``. ``deferred=True``: the
    release returns a ``DeferredSum`` handle and draws no noise yet (module docstring).
    """

    name: str
    value: torch.Tensor | Tensors
    sensitivity: float
    noise_multiplier: float
    deferred: bool = False

    @property
    def std(self) -> float:
        return self.noise_multiplier * self.sensitivity


class NoiseSource:
    """Gaussian noise from a seeded torch generator, or from the OS CSPRNG in secure mode.

    Secure mode draws every sample from ``os.urandom`` (``_secure_normal``: float64
    Box–Muller) and so gives up run-to-run reproducibility. It does *not* fix the
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

    def scalar(self, std: float) -> float:
        """One N(0, std²) draw as a Python float, sampled in float64 (float32 on MPS, which
        has no float64). It goes through ``normal`` (a 0-d tensor), so secure mode uses the
        secure sampler and anything that wraps ``normal`` sees this draw too."""
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        return float(self.normal(torch.zeros((), dtype=dtype, device=self.device), std))

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


class _Draw:
    """What has been drawn for one deferred query; shared by a handle and its ``scaled`` copies."""

    __slots__ = ("gateway", "noisy", "projected")

    def __init__(self, gateway: NoisyRelease):
        self.gateway = gateway
        self.noisy: torch.Tensor | Tensors | None = None  # value + Z, once materialized
        self.projected = False


@dataclass(frozen=True, eq=False)
class DeferredSum:
    """A released sum whose Gaussian noise Z ~ N(0, std² I) is not drawn yet.

    Returned by ``NoisyRelease.release`` for a ``SumQuery(..., deferred=True)``; the release is
    already in the ledger. The noisy value (value + Z)·scale is only reachable through the
    issuing gateway: ``project`` (one scalar, at most once) or ``materialize`` (the full
    vector). ``_value`` is the EXACT, non-private sum: nothing but the gateway may read it.
    """

    name: str
    _value: torch.Tensor | Tensors = field(repr=False)
    std: float
    _draw: _Draw = field(repr=False)
    scale: float = 1.0

    def scaled(self, factor: float) -> DeferredSum:
        """The same release times ``factor`` (e.g. 1/L), sharing its noise: no tensor is touched."""
        return replace(self, scale=self.scale * float(factor))


def _dot(a: torch.Tensor | Tensors, b: torch.Tensor | Tensors) -> float:
    """Σ over tensors of native-precision dot products (as ``tree.dot``), as a Python float.

    The per-tensor products are summed on the device, so there is one host sync per call."""
    if not isinstance(a, dict):
        assert isinstance(b, torch.Tensor)
        return float(_dot1(a, b))
    assert isinstance(b, dict)
    if a.keys() != b.keys():
        raise ValueError(f"projection direction has keys {sorted(b)}, the sum has {sorted(a)}")
    total: torch.Tensor | float = 0.0
    for k in a:
        total = total + _dot1(a[k], b[k])
    return float(total)


def _dot1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if b.dtype != a.dtype:
        b = b.to(a.dtype)
    return torch.dot(a.reshape(-1), b.reshape(-1))


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

    def release(self, *queries: SumQuery, label: str) -> list[torch.Tensor | Tensors | DeferredSum]:
        """Record the joint event, then return each query's value plus N(0, σ_i²) noise
        (a ``DeferredSum`` handle, noise not yet drawn, for a deferred query)."""
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
        return self._noisy_outputs(queries)

    def _noisy_outputs(self, queries: tuple[SumQuery, ...]) -> list[torch.Tensor | Tensors | DeferredSum]:
        """The noisy values (or deferred handles) of queries whose release is already recorded."""
        out: list[torch.Tensor | Tensors | DeferredSum] = []
        for q in queries:
            if q.deferred:
                out.append(DeferredSum(q.name, q.value, q.std, _Draw(self)))
            else:
                out.append(self._add_noise(q.value, q.std))
        return out

    def _add_noise(self, value: torch.Tensor | Tensors, std: float) -> torch.Tensor | Tensors:
        if isinstance(value, dict):
            return {k: v + self.noise.normal(v, std) for k, v in value.items()}
        return value + self.noise.normal(value, std)

    def _draw_of(self, handle: DeferredSum) -> _Draw:
        if handle._draw.gateway is not self:
            raise ValueError(f"deferred release {handle.name!r} was issued by another gateway; "
                             "its noise must come from the gateway (and noise stream) that recorded it")
        return handle._draw

    def project(self, handle: DeferredSum, direction: torch.Tensor | Tensors) -> float:
        """⟨value + Z, direction⟩·scale, drawing only the scalar ⟨Z, direction⟩ ~ N(0, std²‖direction‖²).

        Exact (same law as projecting the full noisy vector) when ``direction`` is independent
        of Z, i.e. not computed from this release's noisy value; that is the caller's argument
        to make. Records nothing: the release was recorded when the handle was issued. At most
        once per handle (a second projection would need to be drawn jointly with the first);
        once materialized, the projection is plain post-processing of the drawn vector.
        """
        draw = self._draw_of(handle)
        if draw.noisy is not None:
            return _dot(draw.noisy, direction) * handle.scale
        if draw.projected:
            raise RuntimeError(
                f"deferred release {handle.name!r} was already projected once; a second projection "
                "must be drawn jointly with the first (materialize before projecting to reuse the vector)."
            )
        draw.projected = True  # before drawing: a failed draw must not leave a retry open
        mean = _dot(handle._value, direction)
        spread = handle.std * math.sqrt(_dot(direction, direction))
        return (mean + self.noise.scalar(spread)) * handle.scale

    def materialize(self, handle: DeferredSum) -> torch.Tensor | Tensors:
        """(value + Z)·scale with the full noise vector Z (drawn once, then kept by the handle,
        so later calls and projections see the same draw). Refused after a projection: Z
        would then have to be drawn conditionally on it."""
        draw = self._draw_of(handle)
        if draw.noisy is None:
            if draw.projected:
                raise RuntimeError(f"deferred release {handle.name!r} was already projected; it cannot be "
                                   "materialized afterwards (materialize before projecting)")
            draw.noisy = self._add_noise(handle._value, handle.std)
        noisy = draw.noisy
        if isinstance(noisy, dict):
            return {k: v * handle.scale for k, v in noisy.items()}
        return noisy * handle.scale


def record_nonprivate(ledger: Ledger, label: str, run: str = "") -> None:
    """A non-private step (the ``nodp`` baseline) is recorded too: its ε is ∞."""
    from dp_accounting import dp_event

    ledger.record(dp_event.NonPrivateDpEvent(), label, run=run)
