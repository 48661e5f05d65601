"""The single place where noise is added to private statistics (a test greps the tree to keep it so).

``NoisyRelease.release`` records one batch's queries' joint ``DpEvent`` (ν = (Σ ν_i⁻²)^(-1/2)) in the ledger, then
draws and adds the noise; a ``DeferredSum`` draws only what a rule reads (docs/privacy.md, "Deferred noise"). Sums
arrive in float64 and are rounded after the noise; secure mode snaps to a grid (docs/privacy.md, item 1b)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import BudgetExceededError
from dptune.release.ledger import Ledger
from dptune.release.sampling import (
    LN2,
    MAX_REFINEMENTS,
    WORD_BITS,
    RandomBits,
    degenerate_bits,
    exponentials,
    stream_seed,
)
from dptune.tree import Flat, Tensors, bases, cast


@dataclass(frozen=True)
class SumQuery:
    """A sum over the sampled examples, to be released with Gaussian noise.

    ``value`` is a tensor or a dict of tensors (e.g. a gradient per parameter); ``sensitivity`` is the L2 sensitivity of
    the whole value under add/remove of one example; the noise std is ``noise_multiplier * sensitivity``.
    ``deferred=True``: the release returns a ``DeferredSum`` handle and draws no noise yet (module docstring)."""

    name: str
    value: torch.Tensor | Tensors
    sensitivity: float
    noise_multiplier: float
    deferred: bool = False

    @property
    def std(self) -> float:
        return self.noise_multiplier * self.sensitivity


def noise_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype noise for ``dtype`` values is drawn and added in: float64 or float32, never a half type (rounded to
    bfloat16 first, it would leave holes that tell neighbouring sums apart: found in review, 1.5·10⁻³ of coordinates)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class NoiseSource:
    """Gaussian noise N(0, std²) without a tail cut-off, seeded (reproducible) or secure: Box–Muller on explicit
    integer bits (``RandomBits``: PCG64DXSM from ``seed``, or ``os.urandom``; a seeded ``torch.Generator`` on
    CUDA), the radius from an exact exponential (docs/privacy.md, "Noise tails"). One stream of standard normals
    per dtype, in chunks: the same seed gives the same standard normals whatever the split of the requests (times std,
    a whole chunk and a buffered slice may round apart in the last bit)."""

    def __init__(self, seed: int, device: torch.device | str = "cpu", secure: bool = False):
        self.device = torch.device(device)
        self.secure = bool(secure)
        self.seed = int(seed)
        self._streams: dict[torch.dtype, _NormalStream] = {}

    def _stream(self, dtype: torch.dtype) -> _NormalStream:
        key = noise_dtype(dtype)
        stream = self._streams.get(key)
        if stream is None:
            sub = None if self.secure else stream_seed(self.seed, f"normal-{str(key).removeprefix('torch.')}")
            stream = self._streams[key] = _NormalStream(key, self.device, sub)
        return stream

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        """N(0, std²) noise shaped like ``like``, in its dtype and on its device."""
        z = self._stream(like.dtype).take(like.numel(), std).view_as(like)  # view_as: 2 µs cheaper than view(shape)
        if z.dtype != like.dtype:
            z = z.to(like.dtype)
        return z if z.device == like.device else z.to(like.device)

    def scalar(self, std: float) -> float:
        """One N(0, std²) draw as a Python float, in float64 (float32 on MPS). Through ``normal`` (a 0-d tensor):
        secure mode uses the secure sampler, and whatever wraps ``normal`` sees this draw too."""
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        return float(self.normal(torch.zeros((), dtype=dtype, device=self.device), std))

    @property
    def drawn(self) -> dict[torch.dtype, int]:
        """How many standard normals each dtype's stream has served so far."""
        return {k: s.served for k, s in self._streams.items()}

    def state(self) -> dict[torch.dtype, dict[str, Any]]:
        """A snapshot of every stream (seeded mode only: secure mode has no state to restore)."""
        if self.secure:
            raise RuntimeError("secure mode reads the OS CSPRNG: it has no state to save or restore")
        return {k: s.state() for k, s in self._streams.items()}

    def set_state(self, state: dict[torch.dtype, dict[str, Any]]) -> None:
        if self.secure:
            raise RuntimeError("secure mode reads the OS CSPRNG: it has no state to save or restore")
        self._streams = {}
        for k, st in state.items():
            self._stream(k).set_state(st)


Words = Callable[[int], Any]  # n → n NEW random words of WORD_BITS bits (numpy or torch int64; modified in place)


class _NormalStream:
    """Standard normals of one dtype, in a fixed order, generated ``chunk`` pairs at a time."""

    # (on a CUDA device?, dtype) → pairs per chunk. On the GPU a chunk costs ~0.75 ms of launches and
    # host syncs whether it holds 2^20 or 2^22 pairs (H200), so chunks are large there (~130 MB of
    # temporaries for float32); on the host 2^15 pairs keep the temporaries in cache.
    CHUNK_PAIRS = {
        (True, torch.float32): 1 << 22,
        (True, torch.float64): 1 << 18,
        (False, torch.float32): 1 << 15,
        (False, torch.float64): 1 << 9,
    }

    def __init__(self, dtype: torch.dtype, device: torch.device, seed: int | None):
        self.dtype, self.device = dtype, device
        self.on_device = device.type == "cuda"  # else numpy on the host (also MPS: no float64 there)
        self.host = RandomBits(seed) if seed is None or not self.on_device else None
        self.generator = None
        if self.host is None:
            self.generator = torch.Generator(device=device).manual_seed(int(seed))  # type: ignore[arg-type]
        self.chunk = self.CHUNK_PAIRS[(self.on_device, dtype)]
        if seed is None:  # secure mode draws whole gradients in float64 (snapping); no stream to keep
            self.chunk = max(self.chunk, 1 << 15)
        self.buf = torch.empty(0, dtype=dtype, device=device if self.on_device else "cpu")
        self.pos = self.served = 0

    def words(self, n: int) -> Any:
        if not self.on_device:
            return self.host.words(n)  # type: ignore[union-attr]
        if self.generator is None:  # secure: the OS CSPRNG's words, copied to the device
            return torch.from_numpy(self.host.words(n)).to(self.device)  # type: ignore[union-attr]
        return torch.randint(0, 1 << WORD_BITS, (n,), generator=self.generator, device=self.device)

    def _chunk(self, out: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        """The next chunk (2·chunk standard normals, times ``scale``), written into ``out`` when given."""
        if self.on_device:
            return _normal_pairs_torch(self.words, self.chunk, self.dtype, out, scale)
        z = _normal_pairs_np(self.words, self.chunk, _NP_DTYPE[self.dtype], None if out is None else out.numpy(), scale)
        return torch.from_numpy(z) if out is None else out

    def take(self, n: int, std: float) -> torch.Tensor:
        """std times the next n standard normals, as a new tensor."""
        self.served += n
        if self.pos + n <= self.buf.numel():
            self.pos += n
            return self.buf[self.pos - n : self.pos].mul(std)
        out = torch.empty(n, dtype=self.dtype, device=self.buf.device)
        o, size = 0, 2 * self.chunk
        while o < n:
            if self.pos == self.buf.numel():
                if n - o >= size:  # a whole chunk straight into the output; the stream is unchanged
                    self._chunk(out[o : o + size], std)
                    o += size
                    continue
                self.buf, self.pos = self._chunk(), 0
            m = min(n - o, self.buf.numel() - self.pos)
            torch.mul(self.buf[self.pos : self.pos + m], std, out=out[o : o + m])
            o, self.pos = o + m, self.pos + m
        return out

    def state(self) -> dict[str, Any]:
        bits = self.host.state() if self.generator is None else self.generator.get_state()  # type: ignore[union-attr]
        return {"bits": bits, "buf": self.buf.clone(), "pos": self.pos, "served": self.served}

    def set_state(self, state: dict[str, Any]) -> None:
        if self.generator is None:
            self.host.set_state(state["bits"])  # type: ignore[union-attr]
        else:
            self.generator.set_state(state["bits"])
        self.buf, self.pos, self.served = state["buf"].clone(), int(state["pos"]), int(state["served"])


_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}
# Bit layouts (why these widths: docs/privacy.md, "Noise tails"). float32: one 62-bit word per pair, ANGLE32 bits
# for the angle, the other 38 for the radius, refined from fresh words below 2^PRECISION32 (probability 2^-18 a pair).
# float64: one 62-bit word for the radius (refined below 2^53) and 53 bits of another for the angle.
ANGLE32, PRECISION32, PRECISION64, ANGLE64 = 24, 20, 53, 53


def _normal_pairs_np(
    words: Words, k: int, dtype: type, out: np.ndarray | None = None, scale: float = 1.0
) -> np.ndarray:
    """2k standard normals (times ``scale``) from integer bits (Box–Muller): [r·cos θ (k), r·sin θ (k)].

    The radius r = √(2E), E from ``exponentials`` (no cut-off: where the radius bits run out it refines from fresh
    words); the layouts are above. The angle's resolution bounds no tail (|z| ≤ r whatever θ); it only rounds the
    direction (docs/privacy.md). ``_normal_pairs_torch`` is the same on a torch device."""
    # In-place numpy (float32: about the cost of torch.randn per draw on one CPU core).
    if dtype == np.float32:
        w = words(k)
        theta = (w & ((1 << ANGLE32) - 1)).astype(np.float32)
        theta *= np.float32(2 * math.pi * 2.0**-ANGLE32)
        w >>= ANGLE32
        r2 = exponentials(words, w, WORD_BITS - ANGLE32, PRECISION32, scale=2.0)  # r² = 2E
    else:
        a = words(k)
        theta = (words(k) >> (WORD_BITS - ANGLE64)).astype(np.float64)
        theta *= 2 * math.pi * 2.0**-ANGLE64
        r2 = exponentials(words, a, WORD_BITS, PRECISION64, scale=2.0)
    r = np.empty(k, dtype=dtype)
    np.sqrt(r2, out=r, casting="same_kind")
    if scale != 1.0:
        r *= dtype(scale)
    out = np.empty(2 * k, dtype=dtype) if out is None else out
    np.cos(theta, out=out[:k])
    out[:k] *= r
    np.sin(theta, out=theta)
    np.multiply(r, theta, out=out[k:])
    return out


def _exponentials_torch(words: Words, a: torch.Tensor, width: int, precision: int, depth: int = 0) -> torch.Tensor:
    """``sampling.exponentials`` on a torch device (float64; the same law, the same recursion)."""
    e = torch.log((a + 1).to(torch.float64).mul_(2.0**-width)).neg_()
    low = (a < (1 << precision)).nonzero().squeeze(1)  # one host sync per chunk
    if low.numel():
        if depth >= MAX_REFINEMENTS:
            raise degenerate_bits()
        e[low] = (width - precision) * LN2 + _exponentials_torch(
            words, words(low.numel()), WORD_BITS, precision, depth + 1
        )
    return e


def _normal_pairs_torch(
    words: Words, k: int, dtype: torch.dtype, out: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """``_normal_pairs_np`` in torch, for words on a CUDA device."""
    if dtype == torch.float32:
        w = words(k)
        theta = (w & ((1 << ANGLE32) - 1)).to(torch.float32).mul_(2 * math.pi * 2.0**-ANGLE32)
        e = _exponentials_torch(words, w >> ANGLE32, WORD_BITS - ANGLE32, PRECISION32)
    else:
        a = words(k)
        theta = (words(k) >> (WORD_BITS - ANGLE64)).to(torch.float64).mul_(2 * math.pi * 2.0**-ANGLE64)
        e = _exponentials_torch(words, a, WORD_BITS, PRECISION64)
    r = e.mul_(2.0).to(dtype).sqrt_()
    if scale != 1.0:
        r.mul_(scale)
    out = torch.empty(2 * k, dtype=dtype, device=r.device) if out is None else out
    torch.mul(r, torch.cos(theta), out=out[:k])
    torch.mul(r, torch.sin(theta), out=out[k:])
    return out


class _Draw:
    """What has been drawn for one deferred query; shared by a handle and its ``scaled`` copies."""

    __slots__ = ("gateway", "noisy", "projected")

    def __init__(self, gateway: NoisyRelease):
        self.gateway = gateway
        self.noisy: torch.Tensor | Tensors | None = None  # value + Z, once materialized
        self.projected = False


@dataclass(frozen=True, eq=False)
class DeferredSum:
    """A released sum (already in the ledger) whose Gaussian noise Z ~ N(0, std² I) is not drawn yet.

    (value + Z)·scale is only reachable through the issuing gateway: ``project`` (one scalar, at most once) or
    ``materialize`` (the full vector). ``_value`` is the EXACT, non-private sum: nothing but the gateway may read it."""

    name: str
    _value: torch.Tensor | Tensors = field(repr=False)
    std: float
    _draw: _Draw = field(repr=False)
    scale: float = 1.0

    def scaled(self, factor: float) -> DeferredSum:
        """The same release times ``factor`` (e.g. 1/L), sharing its noise: no tensor is touched."""
        return replace(self, scale=self.scale * float(factor))


def _dot(a: torch.Tensor | Tensors, b: torch.Tensor | Tensors) -> torch.Tensor | float:
    """Σ over tensors of native-precision dot products (as ``tree.dot``), on the device (no host read)."""
    if not isinstance(a, dict):
        assert isinstance(b, torch.Tensor)
        return _dot1(a, b)
    assert isinstance(b, dict)
    if a.keys() != b.keys():
        raise ValueError(f"projection direction has keys {sorted(b)}, the sum has {sorted(a)}")
    if (ab := bases(a, b)) is not None:
        return _dot1(*ab)
    return sum((_dot1(a[k], b[k]) for k in a), 0.0)


def _wide_dot(a: torch.Tensor | Tensors, b: torch.Tensor | Tensors) -> torch.Tensor:
    """⟨a, b⟩ in float64: products summed by blocks of 1,024, then the block sums, on the device
    (a 0-d tensor): error ≤ γ⁶⁴_k·Σ|a_i b_i|, k = 1,024 + ⌈d/1,024⌉ for d coordinates in all
    (a deferred release's mean; docs/privacy.md, item 1b)."""
    if (ab := bases(a, b)) is not None:
        pairs = [ab]  # one product and one blocking of the whole vector: the same bound
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        pairs = [(a[k], b[k]) for k in a]
    else:
        assert isinstance(b, torch.Tensor)
        pairs = [(a, b)]
    blocks = []
    for x, y in pairs:
        prod = x.reshape(-1).double() * y.reshape(-1).to(x.device, torch.float64)
        blocks.append(torch.nn.functional.pad(prod, (0, -prod.numel() % 1024)).view(-1, 1024).sum(1))
    return torch.cat(blocks).sum()


def snap(value: torch.Tensor, noise: torch.Tensor, std: float) -> torch.Tensor:
    """value + noise (float64) rounded to the grid Λℤ, Λ = 2^(⌊log₂ std⌋ − 3) ∈ (std/16, std/8].

    Computed as Λ·(m + round(t − m + noise/Λ)) with t = value/Λ and m = round(t): every step is exact (power-of-two
    scalings, integers below 2⁵³, Sterbenz) except one float64 addition of size ~|noise|/Λ, so the output's grid cell
    depends on the data only through the true sum (docs/privacy.md, item 1b: what is proven and what is assumed)."""
    lam = math.ldexp(1.0, math.frexp(std)[1] - 4)
    t = value / lam
    m = t.round()
    return (t - m + noise / lam).round_().add_(m).mul_(lam)


def _dot1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if b.dtype != a.dtype:
        b = b.to(a.dtype)
    return torch.dot(a.reshape(-1), b.reshape(-1))


def random_direction(source: NoiseSource, like: Tensors) -> Tensors:
    """z ~ N(0, I) shaped like ``like``: PUBLIC randomness (a search direction of zeroth-order
    estimates, ``privatizers.ZerothOrderClip``), not privacy noise. Drawn here, from the run's own
    ``NoiseSource`` stream for directions, so that every Gaussian draw of dptune stays in this module."""
    return {k: source.normal(v, 1.0) for k, v in like.items()}


ROUNDING = 1e-12  # how far above the planned ν a split release's recombined ν may round


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
        # The planned ν (``RunPlan.noise_multiplier``, snapped by ``context.snap_noise``): a release recombining to
        # less noise, or to a ν beyond rounding above it, is refused before anything is recorded or drawn.
        self.planned_multiplier = planned_multiplier
        # Secure mode: Σ over released coordinates of 2·SNAP_XI, the proven bound on how far the snapped float
        # sampler's privacy loss may be from the ideal one (docs/privacy.md, item 1b).
        self.snap_slack = 0.0

    SNAP_XI = 2e-11

    def release(self, *queries: SumQuery, label: str) -> list[torch.Tensor | Tensors | DeferredSum]:
        """Record the joint event, then return each query's value plus N(0, σ_i²) noise
        (a ``DeferredSum`` handle, noise not yet drawn, for a deferred query)."""
        if not queries:
            raise ValueError("release() needs at least one query")
        nu = accounting.joint_noise_multiplier(q.noise_multiplier for q in queries)
        planned = self.planned_multiplier
        if planned is not None:
            # The parts' (Σ ν_i⁻²)^-½ is exact up to rounding, which may land an ulp above the plan:
            # at least the planned noise is drawn, so the planned (smaller) ν is what is recorded.
            if not planned <= nu <= planned * (1 + ROUNDING):
                raise BudgetExceededError(
                    f"{label}: the queries recombine to ν = {nu!r}, not the planned ν = {planned!r}: not in "
                    "the privacy plan, nothing released (dptune.plan_run snaps ν to one the parts recombine to)."
                )
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
        return [
            DeferredSum(q.name, q.value, q.std, _Draw(self)) if q.deferred else self._add_noise(q.value, q.std)
            for q in queries
        ]

    def _add_noise(self, value: torch.Tensor | Tensors, std: float) -> torch.Tensor | Tensors:
        if not isinstance(value, dict):
            return self._noisy(value, std, value.dtype)
        wide = getattr(value, "wide", value)  # an ``Accumulated`` sum: noise before rounding
        if self.noise.secure or len(value) < 2 or len({v.device for v in wide.values()}) > 1:
            return {k: self._noisy(wide[k], std, v.dtype) for k, v in value.items()}
        # Seeded: each dtype's noise drawn as one tensor (its stream serves the same normals in the same
        # order as per tensor), added and rounded by foreach kernels: ~3 launches, not 3 per tensor.
        dtypes = {k: v.dtype for k, v in value.items()}
        if isinstance(wide, Flat) and wide.base is not None and len(set(dtypes.values())) == 1:
            (dt,) = set(dtypes.values())  # one buffer (a replayed sum): the same normals and roundings at once
            z = self.noise.normal(torch.empty(wide.base.numel(), dtype=noise_dtype(dt), device=wide.base.device), std)
            return Flat((wide.base + z).to(dt), wide.layout)
        out: Tensors = {}
        for dt in dict.fromkeys(dtypes.values()):
            ks = [k for k in value if dtypes[k] == dt]
            z = self.noise.normal(
                torch.empty(sum(wide[k].numel() for k in ks), dtype=noise_dtype(dt), device=wide[ks[0]].device), std
            )
            zs = [v.view(wide[k].shape) for v, k in zip(z.split([wide[k].numel() for k in ks]), ks, strict=True)]
            out.update(zip(ks, torch._foreach_add([wide[k] for k in ks], zs), strict=True))
        return cast(out, dtypes)

    def _noisy(self, v: torch.Tensor, std: float, dtype: torch.dtype) -> torch.Tensor:
        """v + N(0, std²), rounded to ``dtype`` only after the noise is added. Seeded mode: the noise of ``dtype``'s
        stream. Secure mode: float64 noise, the result snapped to the grid of ``snap`` (docs/privacy.md, item 1b)."""
        if self.noise.secure:
            v = v.double()
            self.snap_slack += 2 * self.SNAP_XI * v.numel()
            return snap(v, self.noise.normal(v, std), std).to(dtype)
        if v.dtype == dtype == noise_dtype(dtype):
            return v + self.noise.normal(v, std)
        return (v + self.noise.normal(torch.empty(v.shape, dtype=noise_dtype(dtype), device=v.device), std)).to(dtype)

    def _draw_of(self, handle: DeferredSum) -> _Draw:
        if handle._draw.gateway is not self:
            raise ValueError(
                f"deferred release {handle.name!r} was issued by another gateway; "
                "its noise must come from the gateway (and noise stream) that recorded it"
            )
        return handle._draw

    def project(self, handle: DeferredSum, direction: torch.Tensor | Tensors, host: bool = True) -> Any:
        """⟨value + Z, direction⟩·scale, drawing only the scalar ⟨Z, direction⟩ ~ N(0, std²‖direction‖²).

        Exact when ``direction`` is independent of Z (docs/privacy.md, "Deferred noise"). Records nothing (recorded
        at issue). At most once per handle; once materialized, plain post-processing of the drawn vector. A float,
        or with ``host=False`` a 0-d float64 tensor on the device (no host read) outside secure mode."""
        draw = self._draw_of(handle)
        if draw.noisy is not None:
            got = torch.as_tensor(_dot(draw.noisy, direction), dtype=torch.float64) * handle.scale
            return float(got) if host else got
        if draw.projected:
            raise RuntimeError(
                f"deferred release {handle.name!r} was already projected once; a second projection "
                "must be drawn jointly with the first (materialize before projecting to reuse the vector)."
            )
        draw.projected = True  # before drawing: a failed draw must not leave a retry open
        mean = _wide_dot(getattr(handle._value, "wide", handle._value), direction)
        # ‖v‖² in float64, as the mean: in float32 it underflows to 0 for |v_i| ≲ 4e-23, and a spread of 0 released
        # the exact ⟨S, v⟩ (found in review). In float64 no nonzero float32 or half v squares to 0 or overflows.
        dd = _wide_dot(direction, direction)
        if self.noise.secure:  # the snapping grid needs the spread on the host
            mean_f, dd_f = torch.stack([mean, dd]).tolist()
            spread = handle.std * math.sqrt(dd_f)
            m = torch.tensor(mean_f, dtype=torch.float64)
            self.snap_slack += 2 * self.SNAP_XI
            return float(snap(m, torch.tensor(self.noise.scalar(spread), dtype=torch.float64), spread)) * handle.scale
        # mean + spread·Z, Z ~ N(0, 1) drawn on the device: the same draw as ``scalar(spread)``, one host read.
        z = self.noise.normal(torch.zeros_like(mean), 1.0)
        got = (mean + z * (dd.sqrt() * handle.std)) * handle.scale
        return float(got) if host else got

    def materialize(self, handle: DeferredSum) -> torch.Tensor | Tensors:
        """(value + Z)·scale with the full noise vector Z (drawn once, then kept: later calls and projections see
        the same draw). Refused after a projection: Z would then have to be drawn conditionally on it."""
        draw = self._draw_of(handle)
        if draw.noisy is None:
            if draw.projected:
                raise RuntimeError(
                    f"deferred release {handle.name!r} was already projected; it cannot be "
                    "materialized afterwards (materialize before projecting)"
                )
            draw.noisy = self._add_noise(handle._value, handle.std)
        noisy = draw.noisy
        if isinstance(noisy, dict):
            return {k: v * handle.scale for k, v in noisy.items()}
        return noisy * handle.scale


def record_nonprivate(ledger: Ledger, label: str, run: str = "") -> None:
    """A non-private step (the ``nodp`` baseline) is recorded too: its ε is ∞."""
    ledger.record(dp_event.NonPrivateDpEvent(), label, run=run)
