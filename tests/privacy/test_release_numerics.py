"""Numerics of the release (issue 23, item 9; docs/privacy.md, "Rounding across examples" and
"Snapping").

1. The clipped sum is accumulated across examples in float64 and the gateway adds the noise
   before rounding to the parameters' dtype. A constructed batch (large partial sums near a
   power of two, then tiny terms that a float32 sum absorbs or rounds up to an ulp depending on
   the binade) lets one example move the old float32 sum by C·(1 + 1.6e-3); the released
   pre-noise sum now moves by at most C·(1 + 1e-6), on the vmap path and on the ghost path's
   book-keeping product, Gram rule and Embedding ``index_add``.
2. Secure mode snaps the noisy value to the grid Λℤ, Λ = 2^(⌊log₂σ⌋−3): outputs lie on it, the
   noise passes a Gaussian test at σ that rejects 0.98σ and 1.02σ, and the snapping arithmetic is
   exact even far from 0.
3. Seeded mode draws the same noise stream as before (bit for bit), only the sum is wider.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from dptune import tree
from dptune.gradients import ghost
from dptune.gradients.ghost import GhostGrads, LinearRule, _Embedding
from dptune.gradients.oracle import GradientOracle
from dptune.gradients.persample import MaterializedGrads
from dptune.release.ledger import Ledger
from dptune.release.mechanisms import NoiseSource, NoisyRelease, SumQuery
from dptune.release.privatizers import clipped_sum

C = 1.0


def _adversarial_batch(B: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, x) as one-coordinate gradients: 64 values summing to 2⁶ − ½, then B − 64 values −0.9·ulp,
    an ulp of [32, 64) (each rounds to −1 ulp below 64, is absorbed above it); x = 1.5, clipped to C.
    Old float32 sums: ‖S(D ∪ {x}) − S(D)‖ = C·(1 + 1.6e-3) on this CPU (x first)."""
    ulp = 2.0**-18
    D = torch.cat([torch.full((64, 1), (64 - 0.5) / 64), torch.full((B - 64, 1), -0.9 * ulp)])
    return D, torch.full((1, 1), 1.5)


def _flat(s: dict[str, torch.Tensor]) -> torch.Tensor:
    """A sum as handed to the gateway, flattened in float64: its float64 accumulators
    (``Accumulated.wide``; on the old code, the float32 sum itself)."""
    return torch.cat([v.reshape(-1).double() for v in getattr(s, "wide", s).values()])


def _released(grads: MaterializedGrads) -> torch.Tensor:
    return _flat(clipped_sum(grads, C))


def _vmap(g: torch.Tensor) -> MaterializedGrads:
    return MaterializedGrads({"w": g.reshape(g.shape[0], 1, 1)}, torch.zeros(g.shape[0]))


def _linear(g: torch.Tensor) -> GhostGrads:
    """Rank-one Linear (T = 1): g_i = b_i a_iᵀ with a_i = 1, released by the book-keeping product."""
    W = torch.zeros(1, 1)
    layer = LinearRule({"weight": "w"}, torch.ones(g.shape[0], 1), g.reshape(-1, 1).clone(), W)
    return GhostGrads([layer], torch.zeros(g.shape[0]), {"w": W})


def _linear_tokens(g: torch.Tensor) -> GhostGrads:
    """Linear over T = 2 positions (a = (1, 0)), per-example G not kept: the Gram rule's sum."""
    W = torch.zeros(1, 1)
    B = g.shape[0]
    a = torch.stack([torch.ones(B, 1), torch.zeros(B, 1)], 1)
    b = torch.stack([g.reshape(-1, 1), torch.full((B, 1), 0.25)], 1)
    layer = LinearRule({"weight": "w"}, a, b, W)
    assert layer.G is None, "the Gram rule's release must be exercised"
    return GhostGrads([layer], torch.zeros(B), {"w": W})


def _embedding(g: torch.Tensor) -> GhostGrads:
    """Every example's one token is token 0: its rows meet in ``index_add``."""
    W = torch.zeros(3, 1)
    B = g.shape[0]
    layer = _Embedding(
        {"weight": "w"}, torch.nn.Embedding(3, 1), torch.zeros(B, 1, dtype=torch.long), g.reshape(B, 1, 1), W
    )
    return GhostGrads([layer], torch.zeros(B), {"w": W})


PATHS = {"vmap": _vmap, "linear": _linear, "linear_tokens": _linear_tokens, "embedding": _embedding}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_one_example_moves_the_released_sum_by_at_most_C(path: str, monkeypatch) -> None:
    monkeypatch.setattr(ghost, "MATERIALIZE_LIMIT_BYTES", 0)  # Linear over tokens: the Gram rule
    build = PATHS[path]
    D, x = _adversarial_batch()
    with_x = torch.cat([x, D])
    moved = float((_released(build(with_x)) - _released(build(D))).norm())
    assert moved <= C * (1 + 1e-6), f"{path}: one example moved the released sum by {moved / C - 1:.3g}·C beyond C"


def test_released_sum_is_the_float64_sum_of_each_examples_own_terms() -> None:
    """On random data (a rank-one layer with bias, 120 examples of 40 → 30), the batch's sum
    and the float64 sum of the examples' one-hot releases agree to float64 rounding: no float32
    rounding across examples is left (the old float32 product differs by ~1e-7 relative)."""
    g = torch.Generator().manual_seed(3)
    B, d, p = 120, 40, 30
    W, bias = torch.zeros(p, d), torch.zeros(p)
    a, b = torch.randn(B, d, generator=g), torch.randn(B, p, generator=g)
    grads = GhostGrads([LinearRule({"weight": "w", "bias": "b"}, a, b, W)], torch.zeros(B), {"w": W, "b": bias})
    w = torch.rand(B, generator=g)
    batch = grads.weighted_sum(w)
    alone = []
    for i in range(B):
        e = torch.zeros(B)
        e[i] = w[i]
        grads.reset_reuse()
        alone.append(_flat(grads.weighted_sum(e)))
    got, terms = _flat(batch), torch.stack(alone)
    bound = 2 * (B + 2) * 2.0**-53 * float(terms.abs().sum(0).max())
    assert float((got - terms.sum(0)).abs().max()) <= bound
    # what any other reader sees: the float32 rounding of the float64 sum
    assert isinstance(batch, tree.Accumulated)
    assert all(batch[k].dtype == torch.float32 and torch.equal(batch[k], batch.wide[k].float()) for k in batch)


def _secure_gateway() -> NoisyRelease:
    return NoisyRelease(Ledger(), 0.1, NoiseSource(seed=0, secure=True))


class _Bag(nn.Module):
    """Embedding over 6 positions of a 7-token vocabulary (repeated tokens), then Linear over tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.l = nn.Embedding(7, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(self.e(x)).mean(1)


LAYERS = {  # name → (model, input, MATERIALIZE_LIMIT_BYTES, the release rule it must exercise)
    "embedding+tokens": (_Bag, lambda: torch.randint(0, 7, (40, 6)), 0, "_Embedding"),
    "conv kept": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(48, 3)),
        lambda: torch.randn(40, 2, 6, 6),
        None,
        "_Conv:G",
    ),
    "conv chunked": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(48, 3)),
        lambda: torch.randn(40, 2, 6, 6),
        0,
        "_Conv:e",
    ),
    "conv gram": (
        lambda: nn.Sequential(nn.Conv2d(8, 16, 3), nn.Flatten(), nn.Linear(64, 3)),
        lambda: torch.randn(40, 8, 4, 4),
        0,
        "_Conv:gram",
    ),
}


def _rule(layer: object) -> str:
    kind = "gram" if getattr(layer, "_gram_rule", False) else "G" if getattr(layer, "G", None) is not None else "e"
    return f"{type(layer).__name__}:{kind}" if type(layer).__name__ == "_Conv" else type(layer).__name__


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_every_layer_rule_sums_its_examples_terms_in_float64(name: str, monkeypatch) -> None:
    """Each ghost rule's batch sum is the float64 sum of the examples' own (one-hot) releases, to
    float64 rounding: the float32 sums across examples (Conv ``w @ G``, the chunked and unfolded
    products, ``index_add``) would differ by ~1e-7 relative, 10⁸ times the bound."""
    build, inputs, limit, rule = LAYERS[name]
    if limit is not None:
        monkeypatch.setattr(ghost, "MATERIALIZE_LIMIT_BYTES", limit)
    torch.manual_seed(0)
    model, x = build(), inputs()
    params = {k: p.detach() for k, p in model.named_parameters()}
    g = GradientOracle(model, "cross_entropy", method="ghost")(params, x, torch.randint(0, 3, (x.shape[0],)))
    assert rule in {_rule(layer) for layer in g._layers}
    B = x.shape[0]
    w = torch.rand(B)
    got = _flat(g.weighted_sum(w))
    terms = []
    for i in range(B):
        g.reset_reuse()
        terms.append(_flat(g.weighted_sum(torch.where(torch.arange(B) == i, w, 0.0))))
    total = torch.stack(terms)
    assert float((got - total.sum(0)).abs().max()) <= 2 * (B + 2) * 2.0**-53 * float(total.abs().sum(0).max())


def _snapped_law_pvalue(k: np.ndarray, offsets: np.ndarray, sigma: float, lam: float) -> float:
    """Test of grid indices k = Y/Λ against the law of round((v + Z)/Λ), Z ~ N(0, σ²), where the
    samples come in equal groups, one per value v/Λ in ``offsets``: χ² goodness of fit over the
    cells, those beyond ±3.5σ pooled (every cell then expects ≥ 5 samples, as χ² needs: unpooled
    6σ tails made one sample beyond 5σ, 7 % of runs, a p-value of 1e-38), and a z-test of the
    mean of k² over cells to ±9σ (power against a wrong σ), Bonferroni."""
    edge, inner = int(9 * sigma / lam), int(3.5 * sigma / lam)
    cells = np.arange(-edge, edge + 1)
    cdf = stats.norm.cdf(
        (cells[None, :] + np.array([[-0.5], [0.5]])[:, :, None] - offsets[None, :, None]) * lam / sigma
    )
    prob = (cdf[1] - cdf[0]) * (k.size / offsets.size)  # expected counts [offsets, cells]
    expected = prob.sum(0)
    kept = np.abs(cells) <= inner
    observed = np.bincount((np.clip(k, -inner - 1, inner + 1) + inner + 1).astype(np.int64), minlength=2 * inner + 3)
    observed = np.append(observed[1:-1], observed[0] + observed[-1]).astype(np.float64)
    p_fit = stats.chisquare(observed, np.append(expected[kept], k.size - expected[kept].sum())).pvalue
    m2, m4 = (prob * cells**2).sum(), (prob * cells**4).sum()
    var = m4 - (prob * cells**2).sum(1) ** 2 @ np.full(offsets.size, offsets.size / k.size)
    z = ((k**2).sum() - m2) / math.sqrt(var)
    return float(min(1.0, 2 * min(p_fit, 2 * stats.norm.sf(abs(z)))))


def test_secure_release_lies_on_the_grid_and_has_the_snapped_gaussian_law() -> None:
    sigma, lam = 0.7, 2.0**-4  # Λ = 2^(⌊log₂ 0.7⌋ − 3)
    offsets = np.linspace(-0.5, 0.5, 256, endpoint=False)  # true values spread over one cell
    value = torch.from_numpy(np.repeat(offsets, 512) * lam)
    wide = tree.Accumulated({"w": value}, {"w": torch.float32})
    gate = _secure_gateway()
    (out,) = gate.release(SumQuery("g", wide, 1.0, sigma), label="t")
    assert gate.snap_slack == pytest.approx(2 * gate.SNAP_XI * value.numel())  # the charge, per coordinate
    y = out["w"]
    assert y.dtype == torch.float32
    k = y.double().numpy() / lam
    assert np.array_equal(k, np.round(k)), "secure output off the grid Λℤ"
    assert _snapped_law_pvalue(k, offsets, sigma, lam) > 1e-4
    for wrong in (0.98 * sigma, 1.02 * sigma):  # the same test rejects a 2% wrong σ
        assert _snapped_law_pvalue(k, offsets, wrong, lam) < 1e-6, wrong


def test_snap_is_exact_far_from_zero_and_on_plain_tensors() -> None:
    from dptune.release.mechanisms import snap

    lam = 0.125  # std = 1: Λ = 2^(⌊log₂ 1⌋ − 3)
    v = torch.tensor([1e12 + 0.3 * lam, -1e12 + 0.3 * lam, 0.0], dtype=torch.float64)
    z = torch.tensor([0.25 * lam, 0.25 * lam, 0.49 * lam], dtype=torch.float64)
    got = snap(v, z, 1.0)
    assert torch.equal(got, torch.tensor([1e12 + lam, -1e12 + lam, 0.0], dtype=torch.float64))
    # a plain float32 tensor (e.g. a user's privatizer) and a float64 scalar (DP-ZO) are snapped too
    gate = _secure_gateway()
    (t,) = gate.release(SumQuery("g", torch.zeros(1000), 1.0, 3.0), label="a")
    (s,) = gate.release(SumQuery("zo", torch.tensor(0.1, dtype=torch.float64), 1.0, 3.0), label="b")
    grid = 2.0 ** (math.frexp(3.0)[1] - 4)
    assert t.dtype == torch.float32 and torch.equal(t.double() / grid, (t.double() / grid).round())
    assert float(s) / grid == round(float(s) / grid)


def test_seeded_noise_stream_is_unchanged() -> None:
    """Seeded mode: the released value is (wide sum + the float32 stream's noise) rounded once; the
    noise is exactly what ``NoiseSource(seed).normal`` draws for a float32 tensor, as before."""
    value = torch.randn(5000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 100
    wide = tree.Accumulated({"w": value}, {"w": torch.float32})
    gate = NoisyRelease(Ledger(), 0.1, NoiseSource(seed=5))
    (out,) = gate.release(SumQuery("g", wide, 2.0, 1.5), label="t")
    z = NoiseSource(seed=5).normal(torch.zeros(5000), 3.0)
    assert torch.equal(out["w"], (value + z).float())
    # plain tensors: the old expression, bit for bit
    plain = torch.randn(777)
    (p,) = NoisyRelease(Ledger(), 0.1, NoiseSource(seed=9)).release(SumQuery("g", plain, 1.0, 2.0), label="t")
    assert torch.equal(p, plain + NoiseSource(seed=9).normal(plain, 2.0))


def test_secure_deferred_projection_is_snapped_and_charged_once() -> None:
    """OSO's deferred q̃: the one released scalar ⟨q + Z, v⟩ is snapped on the grid of its own
    std (σ‖v‖ = 2·10 = 20: Λ = 2), and charged as one coordinate."""
    gate = _secure_gateway()
    value = tree.Accumulated({"w": torch.randn(100, dtype=torch.float64)}, {"w": torch.float32})
    (handle,) = gate.release(SumQuery("q", value, 1.0, 2.0, deferred=True), label="t")
    assert gate.snap_slack == 0.0  # nothing drawn yet
    got = gate.project(handle, {"w": torch.ones(100)})
    assert got / 2.0 == round(got / 2.0)
    assert gate.snap_slack == pytest.approx(2 * gate.SNAP_XI)


def test_secure_runs_state_their_float_slack_beside_epsilon() -> None:
    """The snapped sampler's proven slack (2ξ per released coordinate) is printed with ε in secure
    mode, and absent in seeded mode (nothing is snapped there)."""
    import dptune

    torch.manual_seed(0)
    x = torch.randn(200, 5)
    y = (x[:, 0] > 0).long()
    kw = dict(steps=10, expected_batch_size=20, noise_multiplier=1.0, delta=1e-3, lr=0.1, device="cpu")
    secure = dptune.train(torch.nn.Linear(5, 2), (x, y), "dpsgd", secure_mode=True, **kw).summary()
    assert secure["epsilon_float_slack"] == pytest.approx(10 * 12 * 2 * NoisyRelease.SNAP_XI)
    assert "epsilon_float_slack" in secure["randomness_note"]
    assert "epsilon_float_slack" not in dptune.train(torch.nn.Linear(5, 2), (x, y), "dpsgd", **kw).summary()


def test_a_sums_noise_drawn_at_once_equals_the_per_tensor_draws() -> None:
    """The seeded gateway draws a sum's noise per dtype as one vector: bitwise the per-tensor
    release (same normals, same order; added in float64, rounded once), mixed dtypes included."""
    wide = {"a": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float64)}
    wide["c"] = torch.randn(2, 2, dtype=torch.float64)
    value = tree.Accumulated(wide, {"a": torch.float32, "b": torch.float64, "c": torch.float32})
    assert all(torch.equal(value[k], v.to(value[k].dtype)) for k, v in wide.items())  # the fused cast
    got = NoisyRelease(Ledger(), 0.1, NoiseSource(seed=3))._add_noise(value, 0.7)
    one = NoisyRelease(Ledger(), 0.1, NoiseSource(seed=3))
    want = {k: one._noisy(wide[k], 0.7, v.dtype) for k, v in value.items()}
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    wrong = NoisyRelease(Ledger(), 0.1, NoiseSource(seed=4))._add_noise(value, 0.7)
    assert not torch.equal(wrong["a"], want["a"])


def test_a_replayed_sums_noise_on_its_one_buffer_equals_the_per_tensor_draws() -> None:
    """A replayed sum (one float64 buffer, ``tree.Flat``) gets its noise as one vector added to the buffer:
    bitwise the per-tensor release of the same sum held as a plain dict."""
    parts = {"w": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float64)}
    flat = tree.packed(parts, torch.float64, torch.device("cpu"))
    dtypes = {"w": torch.float32, "b": torch.float32}
    got = NoisyRelease(Ledger(), 0.1, NoiseSource(seed=3))._add_noise(tree.Accumulated(flat, dtypes), 0.7)
    assert isinstance(got, tree.Flat) and got.base is not None
    one = NoisyRelease(Ledger(), 0.1, NoiseSource(seed=3))
    want = {k: one._noisy(parts[k], 0.7, torch.float32) for k in parts}
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "accumulated", "pair", "flat"])
def test_half_precision_sums_get_float32_noise_rounded_once(dtype: torch.dtype, form: str) -> None:
    """A bfloat16/float16 parameter's release is (sum + float32 noise) rounded once (found in review: the noise was
    rounded to the half type first; near zero its grid then told the sum 0 from the sum 1 with certainty)."""
    n, std = 200_000, 1.0
    wide = torch.rand(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3
    z = NoiseSource(seed=7).normal(torch.zeros(n), std).double()  # the float32 stream, as a float32 value gets
    gate = NoisyRelease(Ledger(), 0.1, NoiseSource(seed=7))
    if form == "plain":  # a half tensor itself (no float64 sum)
        wide = wide.to(dtype).double()  # the half tensor's own values
        got = gate._noisy(wide.to(dtype), std, dtype)
    elif form == "flat":  # one float64 buffer (a replayed sum)
        got = gate._add_noise(tree.Accumulated(tree.packed({"w": wide, "b": wide[:1]}, torch.float64,
                                                           torch.device("cpu")), {"w": dtype, "b": dtype}), std)["w"]  # fmt: skip
    elif form == "pair":  # two tensors of the half type: one draw per dtype, foreach-added
        got = gate._add_noise(tree.Accumulated({"w": wide, "b": wide[:1]}, {"w": dtype, "b": dtype}), std)["w"]
    else:
        got = gate._add_noise(tree.Accumulated({"w": wide}, {"w": dtype}), std)["w"]
    assert got.dtype == dtype and torch.equal(got, (wide + z).to(dtype))
