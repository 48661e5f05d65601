"""The step fast paths against the straightforward code they replace.

* ``grads.ParamSwap`` (precomputed reparametrisation) against ``torch.func.functional_call``:
  tied weights, buffers, partial dictionaries, a model changed after construction, an
  unknown name, an exception inside the forward.
* The ghost engine's forward capture (instance-level ``forward`` wrappers instead of forward
  hooks): no trace left on the modules, a user's output hook, a layer called through
  ``.forward`` directly.
* ``tree`` helpers: ``scale`` / ``axpy`` / ``lincomb`` bit-identical to the per-tensor
  expressions; ``add_scaled`` / ``ema`` equal to torch's fused ``add(alpha=)`` and close to the
  unfused expressions; ``clip_weights`` bit-identical to the expression it replaced;
  ``heavy_ball(scale=s)`` close to ``heavy_ball`` of the pre-scaled gradient.
* DP-Adam's update bit-identical to its per-tensor equations, AdamWOSM's close to them.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_plan
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from dptune import accounting, tree
from dptune.gradients.oracle import GradientOracle, ParamSwap
from dptune.release.context import StepContext
from dptune.release.ledger import Ledger
from dptune.release.mechanisms import NoiseSource, NoisyRelease
from dptune.release.privatizers import clip_weights
from dptune.strategies import make_strategy
from dptune.updates import heavy_ball


# ----------------------------------------------------------------------------- ParamSwap
class Tied(nn.Module):
    """Embedding and output layer sharing one weight, a buffer used in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 5)
        self.body = nn.Sequential(nn.Linear(5, 5), nn.Tanh())
        self.out = nn.Linear(5, 11, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("shift", torch.linspace(-1, 1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.emb(x) + self.shift))


def _fresh(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g) for k, p in model.named_parameters()}


def _identities(model: nn.Module) -> list[int]:
    return [id(t) for _, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]


@pytest.mark.parametrize("subset", [None, ["body.0.weight"], ["emb.weight"]])
def test_param_swap_equals_functional_call_and_restores_the_model(subset: list[str] | None) -> None:
    torch.manual_seed(0)
    model = Tied()
    before = _identities(model)
    swap = ParamSwap(model)
    x = torch.randint(0, 11, (4, 3))
    for seed in range(3):
        params = _fresh(model, seed)
        if subset is not None:
            params = {k: params[k] for k in subset}
        buffers = {"shift": torch.full((5,), float(seed))}
        want = functional_call(model, (params, buffers), (x,))
        got = swap(params, buffers, x)
        assert torch.equal(got, want)
        assert _identities(model) == before  # the model's own tensors are back
    assert torch.equal(swap({}, {}, x), model(x))


def test_param_swap_follows_a_model_changed_after_construction() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    swap = ParamSwap(model)
    x = torch.randn(5, 4)
    model[2] = nn.Linear(6, 2)  # a replaced submodule
    params = _fresh(model, 1)
    assert torch.equal(swap(params, {}, x), functional_call(model, (params, {}), (x,)))
    model[0].weight = nn.Parameter(torch.randn(6, 4))  # a replaced parameter
    params = _fresh(model, 2)
    assert torch.equal(swap(params, {}, x), functional_call(model, (params, {}), (x,)))
    model.add_module("extra", nn.Linear(2, 2))  # a new layer (not in forward): its name is now known
    params = _fresh(model, 3)
    assert torch.equal(swap(params, {}, x), functional_call(model, (params, {}), (x,)))


def test_param_swap_restores_after_an_exception() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    before = _identities(model)
    swap = ParamSwap(model)
    with pytest.raises(RuntimeError):
        swap(_fresh(model, 0), {}, torch.randn(5, 3))  # wrong input width
    assert _identities(model) == before


def test_param_swap_leaves_unknown_names_to_functional_call() -> None:
    model = nn.Sequential(nn.Linear(4, 6))
    swap = ParamSwap(model)
    x = torch.randn(2, 4)
    params = {**_fresh(model, 0), "nope": torch.zeros(1)}
    assert swap.swap_in(params) is None
    assert torch.equal(swap(params, {}, x), functional_call(model, (params, {}), (x,)))
    assert not hasattr(model, "nope")


# ----------------------------------------------------------------------------- ghost capture
class DirectCall(nn.Module):
    """A parent that calls its layer's ``forward`` directly (no Module.__call__, no hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a.forward(x)))


def _hooked() -> nn.Module:
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    m[0].register_forward_hook(lambda mod, inp, out: out * 2.0)  # a user hook that changes the output
    return m


@pytest.mark.parametrize("build", [DirectCall, _hooked])
def test_ghost_capture_equals_vmap_and_leaves_no_trace(build) -> None:
    torch.manual_seed(0)
    model = build()
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    ghost = GradientOracle(model, "cross_entropy", method="ghost")(params, x, y)
    ref = GradientOracle(model, "cross_entropy", method="vmap")(params, x, y)
    torch.testing.assert_close(ghost.norms, ref.norms, rtol=1e-5, atol=1e-7)
    w = torch.linspace(0.1, 1.0, 7)
    for k, v in ref.weighted_sum(w).items():
        torch.testing.assert_close(ghost.weighted_sum(w)[k], v, rtol=1e-5, atol=1e-7)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_ghost_capture_is_removed_when_the_forward_fails() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    oracle = GradientOracle(model, "cross_entropy", method="ghost")
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    with pytest.raises(RuntimeError):
        oracle(params, torch.randn(4, 5), torch.zeros(4, dtype=torch.long))
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert model[0].weight is dict(model.named_parameters())["0.weight"]


# ----------------------------------------------------------------------------- tree helpers
SHAPES = [(7, 5), (5,), (3, 2, 2), ()]


def _tree(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(s, generator=g, dtype=dtype) * 10 ** (i - 1) for i, s in enumerate(SHAPES)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


scalars = st.floats(1e-6, 10.0, allow_subnormal=False)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), lr=scalars, mu=st.floats(0.0, 0.99), s=scalars)
def test_exact_tree_helpers_are_bit_identical_to_the_per_tensor_expressions(
    seed: int, lr: float, mu: float, s: float
) -> None:
    p, g, m = _tree(seed), _tree(seed + 1), _tree(seed + 2)
    assert _equal(tree.scale(g, s), {k: v * s for k, v in g.items()})
    assert _equal(tree.axpy(-lr, g, p), {k: p[k] - lr * g[k] for k in p})  # the SGD update
    assert _equal(tree.axpy(mu, m, g), {k: mu * m[k] + g[k] for k in g})
    assert _equal(tree.lincomb(mu, m, 1 - mu, g), {k: mu * m[k] + (1 - mu) * g[k] for k in m})
    assert _equal(heavy_ball(p, m, g, lr, mu)[0], {k: p[k] - lr * (mu * m[k] + g[k]) for k in p})
    assert _equal(heavy_ball(p, None, g, lr, 0.0)[0], {k: p[k] - lr * g[k] for k in p})


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), lr=scalars, mu=st.floats(0.0, 0.99), s=scalars)
def test_fused_tree_helpers_are_torch_fused_adds_close_to_the_unfused(
    seed: int, lr: float, mu: float, s: float
) -> None:
    p, g, m = _tree(seed), _tree(seed + 1), _tree(seed + 2)
    fused = tree.add_scaled(p, -lr * s, g)
    assert _equal(fused, {k: torch.add(p[k], g[k], alpha=-lr * s) for k in p})
    pd, gd = {k: v.double() for k, v in p.items()}, {k: v.double() for k, v in g.items()}
    for k in p:  # within a few float32 ulps of the exact value
        exact = pd[k] - lr * s * gd[k]
        tol = 4e-7 * (pd[k].abs() + lr * s * gd[k].abs()) + 1e-30
        assert bool(((fused[k].double() - exact).abs() <= tol).all())
    ema = tree.ema(mu, m, s, g)
    for k in m:
        torch.testing.assert_close(ema[k], mu * m[k] + s * g[k], rtol=2e-6, atol=1e-6 * float(s * g[k].abs().max() + 1))
    for momentum, buf in [(0.0, None), (mu, None), (mu, m)]:
        got, got_buf = heavy_ball(p, buf, g, lr, momentum, scale=s)
        want, want_buf = heavy_ball(p, buf, tree.scale(g, s), lr, momentum)
        for k in p:
            # p − lr·(s·g) rounds differently from the fused form: a few ulps of the *terms*
            # (not of the result, which can cancel: seed=1211, lr=0.84375, s=7.5 failed that way).
            terms = p[k].double().abs() + lr * s * g[k].double().abs()
            if buf is not None:
                terms = terms + lr * momentum * buf[k].double().abs()
            tol = 2e-6 * terms + 1e-6
            assert bool(((got[k].double() - want[k].double()).abs() <= tol).all()), k
        assert (got_buf is None) == (want_buf is None)


def test_tree_helpers_keep_their_inputs_and_accept_empty_dicts() -> None:
    p, g = _tree(0), _tree(1)
    copies = tree.clone(p), tree.clone(g)
    for out in (
        tree.scale(g, 2.0),
        tree.axpy(-0.1, g, p),
        tree.lincomb(0.9, p, 0.1, g),
        tree.add_scaled(p, -0.1, g),
        tree.ema(0.9, p, 0.1, g),
    ):
        assert all(out[k] is not p[k] and out[k] is not g[k] for k in out)
    assert _equal(p, copies[0]) and _equal(g, copies[1])
    assert (
        tree.scale({}, 2.0)
        == tree.axpy(1.0, {}, {})
        == tree.add_scaled({}, 1.0, {})
        == tree.ema(0.5, {}, 1.0, {})
        == {}
    )


def test_clip_weights_is_bit_identical_to_the_clamped_quotient() -> None:
    g = torch.Generator().manual_seed(0)
    norms = torch.cat(
        [
            torch.rand(1000, generator=g) * 10 ** torch.randint(-6, 6, (1000,), generator=g),
            torch.tensor([0.0, 1e-13, 1.0, float("inf")]),
        ]
    )
    for c in (1e-3, 0.1, 1.0, 3.7, 1e4):
        assert torch.equal(clip_weights(norms, c), torch.clamp(c / norms.clamp_min(1e-12), max=1.0))
        assert torch.equal(clip_weights(norms.double(), c), torch.clamp(c / norms.double().clamp_min(1e-12), max=1.0))


# ----------------------------------------------------------------------------- the Adam updates
class _Scripted(NoisyRelease):
    """The real gateway (ledger first), whose 'noisy' value is the exact sum (noise std 0)."""

    def __init__(self) -> None:
        super().__init__(Ledger(), 0.1, NoiseSource(0))

    def release(self, *queries, label):  # type: ignore[override]
        nu = accounting.joint_noise_multiplier(q.noise_multiplier for q in queries)
        self.ledger.record(accounting.gaussian_step_event(nu, self.sampling_rate), label)
        return [q.value for q in queries]


def _steps(name: str, **hp) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Parameters after each of 4 steps, and the released sums, with a fixed per-sample batch."""
    from dptune.gradients.oracle import MaterializedGrads

    strat = make_strategy(name, **hp)
    g = torch.Generator().manual_seed(0)
    per = {"w": torch.randn(6, 4, 3, generator=g), "b": torch.randn(6, 4, generator=g)}
    p = {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(4)}
    run = run_plan(1.0, 0.1, 5.0, 10)
    state, gate, out, sums = strat.init(p, run), _Scripted(), [], []
    for t in range(1, 5):
        ctx = StepContext(t=t, x=torch.zeros(6, 1), y=torch.zeros(6), oracle=None, release=gate, run=run)  # type: ignore[arg-type]
        grads = MaterializedGrads({k: v * t for k, v in per.items()}, torch.zeros(6))
        ctx._grads = grads
        sums.append(grads.weighted_sum(clip_weights(grads.norms, hp["clip"])))
        p, state, _ = strat.step(p, state, ctx)
        out.append(p)
    return out, sums


def test_dpadam_update_is_bit_identical_to_its_equations() -> None:
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    got, sums = _steps("dpadam", lr=lr, clip=0.7, beta1=b1, beta2=b2, eps=eps)
    g = torch.Generator().manual_seed(0)
    torch.randn(6, 4, 3, generator=g), torch.randn(6, 4, generator=g)
    p = {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(4)}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    for t, s in enumerate(sums, start=1):
        gt = {k: x * (1.0 / 5.0) for k, x in s.items()}
        m = {k: b1 * m[k] + (1 - b1) * gt[k] for k in gt}
        v = {k: b2 * v[k] + (1 - b2) * gt[k] * gt[k] for k in gt}
        c1, c2 = 1 - b1**t, 1 - b2**t
        p = {k: p[k] - lr * (m[k] / c1) / ((v[k] / c2).sqrt() + eps) for k in p}
        assert _equal(got[t - 1], p)


def test_adamwosm_update_matches_its_equations() -> None:
    clip, alpha, b1, L, nu = 0.7, 1e-3, 0.9, 5.0, 1.0
    got, sums = _steps("adamwosm", clip=clip, alpha=alpha, beta1=b1)
    lr = alpha / (nu * clip / L + 1e-8)
    g = torch.Generator().manual_seed(0)
    torch.randn(6, 4, 3, generator=g), torch.randn(6, 4, generator=g)
    p = {"w": torch.randn(4, 3, generator=g).double(), "b": torch.zeros(4, dtype=torch.float64)}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    for t, s in enumerate(sums, start=1):
        m = {k: b1 * m[k] + (1 - b1) * s[k].double() / L for k in m}
        p = {k: p[k] - lr * m[k] / (1 - b1**t) for k in p}
        for k in p:
            torch.testing.assert_close(got[t - 1][k].double(), p[k], rtol=1e-5, atol=1e-6)


def test_fused_updates_overflow_like_unfused_ones():
    """A coefficient beyond float32's range (lr = 1e300) gives ±inf, as θ − lr·g would, not an error."""
    y = {"w": torch.zeros(3)}
    x = {"w": torch.tensor([1.0, -1.0, 0.0])}
    out = tree.add_scaled(y, -1e300, x)["w"]
    assert out[0] == -math.inf and out[1] == math.inf and bool(out[2].isnan() or out[2] == 0)
    e = tree.ema(0.9, y, 1e300, x)["w"]
    assert e[0] == math.inf and e[1] == -math.inf
