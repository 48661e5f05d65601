"""Poisson sampling (and full batch), matching what the accountant assumes.

Each step, every example is included independently with probability q = L/n. The realised batch size varies (it can be
0); sums are normalised by the *expected* batch size L, never the realised one, because the realised size is itself
private. Full batch is q = 1."""

from __future__ import annotations

import hashlib
import math
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dptune.errors import ConfigError

WORD_BITS = 62  # every random word: 62 uniform bits in a non-negative int64 (numpy and torch alike)
LN2 = math.log(2.0)


def stream_seed(seed: int, stream: str) -> int:
    """Independent 63-bit seeds for the named random streams of one run (sampling, noise, ...).

    Every bit of ``seed`` counts (any Python int, negative too); seeds in [0, 2³²) keep the streams
    they always had (docs/privacy.md, item 9d)."""
    s = int(seed)
    tag = [ord(c) for c in stream]
    if 0 <= s < 1 << 32:
        entropy = [s, *tag]
    else:
        words, mag = [], abs(s)
        while mag:
            words.append(mag & 0xFFFFFFFF)
            mag >>= 32
        marker = 0x80000000 | (0x40000000 if s < 0 else 0) | len(words)
        entropy = [words[0], *tag, *words[1:], marker]
    return int(np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint64)[0] >> 1)


class RandomBits:
    """Uniform random words of ``WORD_BITS`` bits (int64 ≥ 0): the raw randomness of a stream.

    ``seed`` given: a PCG64DXSM generator seeded with it (reproducible: the same seed gives the same words).
    ``seed=None`` (secure mode): every word is read from the operating system's CSPRNG (``os.urandom``), so nothing in
    the configuration determines it. Transforms (``exponentials``, ``mechanisms`` for Gaussians) read explicit integer
    bits, so what they produce does not depend on a library's float-sampling internals."""

    def __init__(self, seed: int | None):
        self._bg = None if seed is None else np.random.PCG64DXSM(int(seed))

    def words(self, n: int) -> np.ndarray:
        if self._bg is None:
            raw = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(64 - WORD_BITS)
        else:
            raw = self._bg.random_raw(n)
            raw >>= np.uint64(64 - WORD_BITS)
        return raw.view(np.int64)

    def state(self) -> dict[str, Any]:
        if self._bg is None:
            raise RuntimeError("secure mode reads the OS CSPRNG: it has no state to save or restore")
        return self._bg.state

    def set_state(self, state: dict[str, Any]) -> None:
        if self._bg is None:
            raise RuntimeError("secure mode reads the OS CSPRNG: it has no state to save or restore")
        self._bg.state = state


MAX_REFINEMENTS = 32  # levels of exponentials' tail recursion before the bits are judged degenerate


def degenerate_bits() -> RuntimeError:
    return RuntimeError(
        f"the random source returned {MAX_REFINEMENTS} levels of all-zero bits in a row (probability "
        "< 2^-1000 for real randomness): it is broken. Nothing was released with these draws."
    )


def exponentials(
    words: Callable[[int], np.ndarray], a: np.ndarray, width: int, precision: int, scale: float = 1.0, depth: int = 0
) -> np.ndarray:
    """``scale`` times Exp(1) draws (float64) with no cut-off, from integers ``a`` uniform on [0, 2^width).

    E = −ln U with U = (a + 1)·2^−width; where a < 2^precision the grid would cap E, so E is (width − precision)·ln 2
    plus a fresh draw (memoryless: no cut-off at any depth; docs/privacy.md, "Noise tails"). Raises after
    ``MAX_REFINEMENTS`` levels of zeros. Torch twin: ``mechanisms._exponentials_torch``."""
    step = 2.0**-width
    e = a * step  # float64; exact for width ≤ 53 (a < 2^53), rounded to nearest above
    e += step  # U = (a + 1)·2^-width
    np.log(e, out=e)
    e *= -scale  # four passes over the array (it is the noise's hot path)
    low = np.flatnonzero(a < (1 << precision))
    if low.size:
        if depth >= MAX_REFINEMENTS:
            raise degenerate_bits()
        e[low] = scale * (width - precision) * LN2 + exponentials(
            words, words(low.size), WORD_BITS, precision, scale, depth + 1
        )
    return e


def forward_rng(key: bytes) -> None:
    """torch's (dropout masks), numpy's and ``random``'s generators seeded from ``key`` (44 bytes: the OS CSPRNG's, or
    the secret seed's) each step: known masks let one example move the others' (privacy.md; review: 16·C)."""
    seed = int.from_bytes(key[:8], "little")  # torch.manual_seed costs 90 µs (every device type): 2 µs
    torch.default_generator.manual_seed(seed)  # the CPU generator keeps 32 bits of it; CUDA's 64
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    if torch.backends.mps.is_available():  # Apple GPUs (found in review: never reseeded)
        torch.mps.manual_seed(seed)
    np.random.seed(int.from_bytes(key[8:12], "little"))  # masks drawn by numpy (HF audio)
    random.seed(key[12:44])


class PoissonSampler:
    """Draws index sets with Poisson sampling at rate q from ``n`` examples.

    Randomness: ``RandomBits`` seeded from ``stream_seed(seed, "sampling")``, or the OS CSPRNG with ``secure=True``.
    In seeded mode whoever knows the seed can regenerate every batch, losing the amplification by subsampling."""

    def __init__(self, n: int, sampling_rate: float, seed: int, secure: bool = False):
        if n <= 0:
            raise ConfigError(f"the training set is empty (n = {n}); provide at least one example.")
        if not (0 < sampling_rate <= 1):
            raise ConfigError(
                f"sampling rate q must lie in (0, 1], got {sampling_rate}. Use an expected batch "
                f"size between 1 and n = {n}."
            )
        self.n = n
        self.q = float(sampling_rate)
        self.secure = bool(secure)
        self.bits = RandomBits(None if secure else stream_seed(seed, "sampling"))
        self.forward_seed, self.t = stream_seed(seed, "forward"), 0

    def reseed_forward(self) -> None:
        """``forward_rng`` for the next batch's forward: OS bytes, or the secret seed's for step t."""
        self.t += 1
        key = f"{self.forward_seed}/{self.t}".encode()
        forward_rng(os.urandom(44) if self.secure else hashlib.blake2b(key, digest_size=44).digest())

    def sample(self) -> torch.Tensor:
        """The sorted indices of one Poisson batch: each of the n examples independently with prob. q.

        Drawn by geometric skips, G = ⌊E / λ⌋ + 1 with λ = −log(1 − q): the same law as n coin flips
        from ~qn words, q at float64 precision, gaps never capped (docs/performance.md, "2b")."""
        self.reseed_forward()
        if self.q >= 1.0:  # full batch
            return torch.arange(self.n)
        n, q = self.n, self.q
        lam = -math.log1p(-q)
        words = self.bits.words
        parts: list[np.ndarray] = []
        last = -1  # the last included index so far
        while True:
            m = _chunk_size((n - 1 - last) * q)
            # numpy for the arithmetic: ~1 µs per call on these short vectors, 5–15 µs in torch.
            e = exponentials(words, words(m), WORD_BITS, 53)
            # A gap of n or more ends the batch: capped there, the int64 cast cannot overflow (tiny q).
            idx = last + np.cumsum(np.minimum(np.floor(e / lam), n).astype(np.int64) + 1)
            k = int(np.searchsorted(idx, n))  # idx is increasing: the first k are < n
            parts.append(idx[:k])
            if k < m:
                break
            last = int(idx[-1])
        return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))

    def state(self) -> dict[str, Any]:
        """The seeded stream's state (secure mode has none: ``RuntimeError``)."""
        return self.bits.state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.bits.set_state(state)


def _chunk_size(left: float) -> int:
    """Skips drawn at once when ``left`` inclusions are expected: one draw suffices but with prob. < 1e-9."""
    return int(left + 6.0 * math.sqrt(left) + 16)


# Below this rate a Poisson batch is empty for ~10¹² steps and the accountants' float arithmetic
# breaks down (q = 7e-324 from a batch of 1e-320 ran for minutes, then printed overflow warnings).
MIN_SAMPLING_RATE = 1e-12
# A bound on the steps of one run: beyond it the plan itself (evaluation schedule, PLD grids) takes
# gigabytes (10¹² steps once asked for a 10¹¹-entry schedule: a MemoryError, not an error line).
MAX_STEPS = 10**7


def default_batch_size(n: int) -> int:
    """The expected batch size when none is given: L = min(256, max(1, round(n / 10))), so q ≤ 0.1 until
    n = 2,560 and T = epochs / q ≥ 10·epochs. A function of n only, which the accountant treats as public
    (q = L/n): a fixed 256 failed on n = 240 and gave q = 0.56 (9 steps) on n = 455."""
    return min(256, max(1, round(n / 10)))


def sampling_rate_for(n: int, expected_batch_size: float | None, full_batch: bool = False) -> float:
    if full_batch or expected_batch_size is None:
        return 1.0
    if not (0 < expected_batch_size <= n):
        raise ConfigError(
            f"expected batch size must lie in (0, n = {n}], got {expected_batch_size}. "
            f"Fix: use a batch of at most {n} examples, or full_batch=True for q = 1."
        )
    q = float(expected_batch_size) / n
    if q < MIN_SAMPLING_RATE:
        raise ConfigError(
            f"expected batch size {expected_batch_size:g} of n = {n} examples gives a sampling rate q = {q:.3g}, "
            f"below {MIN_SAMPLING_RATE:g}: almost every batch would be empty. Fix: use a batch of at least "
            f"{MIN_SAMPLING_RATE * n:.3g} examples (typically 64 to 4096)."
        )
    return q


def check_steps(steps: float, where: str = "steps") -> None:
    """At most ``MAX_STEPS`` steps per run: a clear error, not a MemoryError later."""
    if steps > MAX_STEPS:
        raise ConfigError(
            f"{where} gives {steps:.4g} steps per run, more than {MAX_STEPS:.0e}, the most dptune plans. "
            "Fix: train fewer steps or epochs (or use a larger batch: an epoch is n/L steps)."
        )


def steps_for_epochs(epochs: float, sampling_rate: float) -> int:
    """T = ceil(epochs / q): an epoch is n/L expected steps (at most ``MAX_STEPS``)."""
    if not (epochs > 0) or not math.isfinite(epochs):  # nan and inf too
        raise ConfigError(f"epochs must be a finite number > 0, got {epochs}. Fix: e.g. epochs = 5.")
    steps = epochs / sampling_rate - 1e-9
    check_steps(steps, f"epochs = {epochs:g} at q = {sampling_rate:.3g}")
    return max(1, int(np.ceil(steps)))
