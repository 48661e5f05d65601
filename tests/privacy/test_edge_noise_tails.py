"""Issue 10, item 2: the Gaussian noise has no tail cut-off.

Float32 ``torch.randn`` is Box–Muller on 24-bit uniforms, so |z| ≤ √(48 ln 2) = 5.77σ, and the
old secure sampler (53-bit uniforms) stopped at √(106 ln 2) = 8.57σ: outputs beyond are
impossible, an event of infinite privacy loss (docs/privacy.md, "Noise tails"). The noise is now
Box–Muller on explicit integer bits whose radius is an exact exponential: where the bits run out
(U ≤ 2^-14) the exponential's memorylessness refines it from fresh bits, without a bound.

Checked here, each against independent reference values or laws:
* extreme bits give |z| beyond both old cut-offs (fails on the old code: it stops at 8.57);
* the exponential: exact values for explicit bits; the refined tail (E − c given E ≥ c) is
  Exp(1) by KS, and the same test rejects Exp(1.1);
* the noise law (KS, std) for float32/float64, seeded and secure, which REJECTS σ off by 10%;
  the frequency of |z| > 4 matches 2Φ̄(4);
* numpy (host) and torch (CUDA) transforms agree on the same bits; seeded draws are a fixed
  stream (split-invariant, per dtype), state round-trips, degenerate bits raise.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from scipy import stats

from dptune.release import mechanisms
from dptune.release.ledger import Ledger
from dptune.release.mechanisms import NoiseSource, NoisyRelease, SumQuery
from dptune.release.sampling import LN2, WORD_BITS, RandomBits, exponentials

OLD_FLOAT32_CUTOFF = math.sqrt(48 * LN2)  # 5.77: torch.randn float32, 24-bit uniforms
OLD_SECURE_CUTOFF = math.sqrt(106 * LN2)  # 8.57: the old secure sampler, 53-bit uniforms


def normal_ks_pvalue(x: np.ndarray, sd: float) -> float:
    """KS of x/sd against N(0, 1) and of |x|/sd against the half-normal (Bonferroni)."""
    z = np.asarray(x, dtype=np.float64) / sd
    return float(min(1.0, 2 * min(stats.kstest(z, "norm").pvalue, stats.kstest(np.abs(z), stats.halfnorm.cdf).pvalue)))


def replay(words: np.ndarray):
    """A word source that hands out copies of ``words`` in order (the transforms work in place)."""
    pos = [0]

    def take(n: int) -> np.ndarray:
        out = words[pos[0] : pos[0] + n].copy()
        assert out.size == n, "replay ran out of words"
        pos[0] += n
        return out

    return take


def zero_reads_then_random(monkeypatch: pytest.MonkeyPatch, zero_reads: int) -> list[int]:
    """os.urandom returns zero bytes for its first ``zero_reads`` calls, then fixed random bytes."""
    reads: list[int] = []
    rng = np.random.default_rng(0)

    def fake(n: int) -> bytes:
        reads.append(n)
        return bytes(n) if len(reads) <= zero_reads else rng.bytes(n)

    monkeypatch.setattr(os, "urandom", fake)
    return reads


# ----------------------------------------------------------------------------- no cut-off
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_bits_give_noise_beyond_the_old_cut_offs(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """All-zero bits are the far tail (u → 0). The old samplers map them to their cut-off
    (5.77σ for float32 randn, 8.57σ for the old secure sampler); now the radius keeps growing
    with every level of zero bits. Fails on the old code (secure draw = 8.57 exactly)."""
    zero_reads_then_random(monkeypatch, zero_reads=12)
    z = NoiseSource(0, secure=True).normal(torch.zeros(8, dtype=dtype), 1.0)
    assert z.dtype == dtype
    assert float(z[0]) > 11.0 > OLD_SECURE_CUTOFF > OLD_FLOAT32_CUTOFF  # θ = 0 (zero bits): z = r


def test_radius_grows_without_bound_with_the_depth_of_zero_bits() -> None:
    """Float32 layout, one word per pair: 24 angle bits, 38 radius bits; radius bits < 2^20
    refine from a fresh 62-bit word (then refined below 2^20 again). Reference, L levels:
    E = (38 − 20) ln 2 + (62 − 20) ln 2·(L − 1) − ln U_L."""
    assert (mechanisms.ANGLE32, mechanisms.PRECISION32) == (24, 20)
    k = 4
    last = np.full(k, (1 << 61) - 1, dtype=np.int64)  # U = (2^61)·2^-62 = 1/2 at the last level
    for levels in (1, 2, 3, 5):
        first = np.zeros(k, dtype=np.int64)  # θ = 0 and radius bits 0: refine
        words = np.concatenate([first] + [np.zeros(k, np.int64)] * (levels - 1) + [last])
        z = mechanisms._normal_pairs_np(replay(words), k, np.float32)
        e_ref = 18 * LN2 + 42 * LN2 * (levels - 1) + LN2
        assert z[0] == pytest.approx(math.sqrt(2 * e_ref), rel=1e-6)  # r·cos 0
        assert abs(z[k]) < 1e-6  # r·sin 0
    assert math.sqrt(2 * (18 + 42 * 4 + 1) * LN2) > 16  # 5 levels: past 16σ, nowhere near a cut-off


def test_exponentials_on_explicit_bits() -> None:
    """E = −ln((a + 1)·2^−width), refined below 2^precision; reference values by hand."""

    def no_words(n: int) -> np.ndarray:
        raise AssertionError("no refinement expected")

    a = np.array([(1 << 38) - 1, (1 << 37) - 1, 1 << 24, 12345678901], dtype=np.int64)
    e = exponentials(no_words, a, 38, 24)
    ref = [0.0, LN2, -math.log(((1 << 24) + 1) * 2.0**-38), -math.log(12345678902 * 2.0**-38)]
    np.testing.assert_allclose(e, ref, rtol=1e-14, atol=1e-300)
    # a = 5 < 2^24: E = 14 ln 2 + (a fresh 62-bit exponential: U = 2^61·2^-62 → ln 2)
    e = exponentials(replay(np.array([(1 << 61) - 1], np.int64)), np.array([5], np.int64), 38, 24)
    assert e[0] == pytest.approx(15 * LN2, rel=1e-14)


def test_the_refined_tail_is_exactly_exponential() -> None:
    """Given E ≥ c the excess is Exp(1) (memorylessness): feed only radius bits < 2^24, so every
    draw is refined; E − 14 ln 2 must pass a KS test against Exp(1) and fail one against Exp(1.1).
    Two levels deep (the refined bits forced < 2^24 too): E − 52 ln 2 ~ Exp(1) as well."""
    bits = RandomBits(7)
    n = 40_000
    a = bits.words(n) & ((1 << 24) - 1)
    excess = exponentials(bits.words, a, 38, 24) - 14 * LN2
    assert excess.min() >= 0
    assert stats.kstest(excess, "expon").pvalue > 1e-3
    assert stats.kstest(excess, "expon", args=(0, 1.1)).pvalue < 1e-6

    def low_then_real(m: int, calls: list[int] = [0]) -> np.ndarray:  # noqa: B006 - a call counter
        calls[0] += 1
        w = bits.words(m)
        return w & ((1 << 24) - 1) if calls[0] == 1 else w

    deep = exponentials(low_then_real, bits.words(n) & ((1 << 24) - 1), 38, 24) - 52 * LN2
    assert deep.min() >= 0 and stats.kstest(deep, "expon").pvalue > 1e-3


def test_degenerate_bits_raise_instead_of_recursing_forever() -> None:
    with pytest.raises(RuntimeError, match="broken"):
        exponentials(lambda n: np.zeros(n, np.int64), np.zeros(3, np.int64), 38, 24)
    with pytest.raises(RuntimeError, match="broken"):
        mechanisms._exponentials_torch(
            lambda n: torch.zeros(n, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 38, 24
        )


# ----------------------------------------------------------------------------- the law
@pytest.mark.parametrize(
    ("dtype", "secure", "n"),
    [(torch.float32, False, 200_000), (torch.float64, False, 100_000), (torch.float32, True, 100_000)],
)
def test_noise_has_the_normal_law_and_the_test_rejects_a_wrong_sigma(
    dtype: torch.dtype, secure: bool, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(99)
    monkeypatch.setattr(os, "urandom", lambda k: rng.bytes(k))  # the secure path on fixed bytes: reproducible
    sigma = 0.37
    gate = NoisyRelease(Ledger(), 0.1, NoiseSource(5, secure=secure))
    (out,) = gate.release(
        SumQuery("g", {"w": torch.zeros(n // 2, dtype=dtype), "b": torch.zeros(n - n // 2, dtype=dtype)}, 1.0, sigma),
        label="t",
    )
    assert out["w"].dtype == out["b"].dtype == dtype
    z = torch.cat([out["w"], out["b"]]).double().numpy()
    if secure:  # snapped to Λℤ (test_release_numerics.py): jittered within its cell, normal up to O(Λ²)
        lam = 2.0 ** (math.frexp(sigma)[1] - 4)
        assert np.array_equal(z / lam, np.round(z / lam))
        z = z + rng.uniform(-lam / 2, lam / 2, z.size)
    assert normal_ks_pvalue(z, sigma) > 1e-4
    for wrong in (0.9 * sigma, 1.1 * sigma):  # power: σ off by 10% is rejected
        assert normal_ks_pvalue(z, wrong) < 1e-6
    assert abs(z.mean()) < 4.5 * sigma / math.sqrt(n)


def test_tail_frequency_matches_the_normal_law() -> None:
    """P(|Z| > 4) = 6.33e-5: the count over 4M float32 draws is Poisson(253) (±5 sd)."""
    n = 4_000_000
    z = NoiseSource(11).normal(torch.zeros(n), 1.0).abs()
    expected = n * 2 * stats.norm.sf(4.0)
    count = int((z > 4.0).sum())
    assert abs(count - expected) < 5 * math.sqrt(expected), (count, expected)
    # a 10% wrong σ would put the count at ~105 or ~507: far outside
    assert abs(n * 2 * stats.norm.sf(4.0 / 1.1) - expected) > 10 * math.sqrt(expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_and_torch_transforms_agree_on_the_same_bits(dtype: type) -> None:
    """The host (numpy) and CUDA (torch) code paths are one construction: same bits, same normals."""
    words = RandomBits(3).words(300_000)
    k = 20_000
    host = mechanisms._normal_pairs_np(replay(words), k, dtype)
    np_replay = replay(words)
    dev = mechanisms._normal_pairs_torch(
        lambda n: torch.from_numpy(np_replay(n)), k, torch.float32 if dtype == np.float32 else torch.float64
    )
    tol = 2e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(dev.numpy(), host, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- the stream
def test_seeded_noise_is_one_fixed_stream_per_dtype() -> None:
    """The same seed gives the same draws whatever the split of the requests (chunks included),
    float64 draws in between do not shift the float32 stream, and another seed differs."""
    sizes = [10, 70_000, 3, 65_536 * 2 + 7, 1]
    a = NoiseSource(3)
    parts = []
    for s in sizes:
        parts.append(a.normal(torch.zeros(s), 1.0))
        a.scalar(1.0)  # a float64 draw in between
    b = NoiseSource(3).normal(torch.zeros(sum(sizes)), 1.0)
    assert torch.equal(torch.cat(parts), b)
    assert a.drawn == {torch.float32: sum(sizes), torch.float64: len(sizes)}
    assert not torch.equal(NoiseSource(4).normal(torch.zeros(100), 1.0), b[:100])
    # std enters exactly; half precision comes from the float32 stream
    assert torch.equal(NoiseSource(3).normal(torch.zeros(5), 2.5), b[:5] * 2.5)
    h = NoiseSource(3).normal(torch.zeros(5, dtype=torch.bfloat16), 1.0)
    assert h.dtype == torch.bfloat16 and torch.equal(h, b[:5].to(torch.bfloat16))


def test_state_round_trips_and_secure_mode_has_none() -> None:
    src = NoiseSource(9)
    src.normal(torch.zeros(1000), 1.0)
    src.scalar(1.0)
    st = src.state()
    x = (src.normal(torch.zeros(70_000), 1.0), src.scalar(2.0))
    src.set_state(st)
    y = (src.normal(torch.zeros(70_000), 1.0), src.scalar(2.0))
    assert torch.equal(x[0], y[0]) and x[1] == y[1]
    with pytest.raises(RuntimeError, match="no state"):
        NoiseSource(9, secure=True).state()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_noise_law_determinism_and_tail() -> None:
    dev = torch.device("cuda")
    a = NoiseSource(1, device=dev).normal(torch.zeros(3_000_000, device=dev), 0.5)
    b = NoiseSource(1, device=dev).normal(torch.zeros(3_000_000, device=dev), 0.5)
    assert a.device.type == "cuda" and torch.equal(a, b)
    z = a.double().cpu().numpy()
    assert normal_ks_pvalue(z, 0.5) > 1e-4 and normal_ks_pvalue(z, 0.55) < 1e-6
    s = NoiseSource(1, device=dev, secure=True).normal(torch.zeros(200_000, device=dev), 0.5)
    assert normal_ks_pvalue(s.double().cpu().numpy(), 0.5) > 1e-4
    calls = [0]

    def zeros_then_half(n: int) -> torch.Tensor:  # first the pair words (θ = 0, radius bits 0), then U = 1/2
        calls[0] += 1
        return torch.full((n,), 0 if calls[0] == 1 else (1 << 61) - 1, dtype=torch.int64, device=dev)

    z = mechanisms._normal_pairs_torch(zeros_then_half, 4, torch.float32)
    assert float(z[0]) == pytest.approx(math.sqrt(2 * 19 * LN2), rel=1e-6)  # one refinement level on the device
    assert WORD_BITS == 62
