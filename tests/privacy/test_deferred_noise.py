"""Deferred noise: a released sum whose Gaussian noise is drawn as one projection.

``SumQuery(..., deferred=True)`` makes ``NoisyRelease.release`` record the event as usual and
return a ``DeferredSum`` handle; ``NoisyRelease.project(h, v)`` then draws the scalar
⟨Z, v⟩ ~ N(0, σ²‖v‖²) instead of the whole vector Z. OSO's exp and additive rules use it for
q̃_t, which they only read through g̃_{t+1}ᵀq̃_t. Checked here:

* the law of a projection is that of ⟨value + Z, v⟩·scale with the full vector Z (exact-normal
  KS tests, which must also REJECT a σ off by ±10%; two-sample KS against materialized draws);
* the scalar draw is float64 and secure mode uses the secure sampler;
* a handle is projected at most once, never materialized after a projection, only through the
  gateway that issued it; a projection records nothing; a refused release draws nothing;
* OSO: the same ledger as the eager path, one full-size draw per parameter tensor per step (not
  two), the metric g_dot_q equals g̃_{t+1}ᵀQ_t/L² computed from the recorded queries when the
  noise is negligible (fails for a wrong vector or a forgotten 1/L), the same C trajectory as the
  eager path, and OSO still trains;
* the mutants in ``tests/mutants`` still act on the deferred path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_gaussian_std, gateway, run_strategy_steps
from mutants import _release_accounting_first_query_only, noise_scaled, q_noise_removed
from scipy import stats
from torch import nn

from dptune import accounting
from dptune.errors import BudgetExceededError
from dptune.release import mechanisms
from dptune.release.ledger import Ledger
from dptune.release.mechanisms import DeferredSum, NoiseSource, NoisyRelease, SumQuery
from dptune.release.privatizers import OSOClip
from dptune.strategies import OSO
from dptune.train import train

# A fixed sum Q (two tensors, like a model's parameters) and direction V, chosen so that the
# projection's mean ⟨Q, V⟩ is ~5 standard deviations away from 0 at STD.
Q = {"w": torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]]), "b": torch.tensor([2.0, -0.5, 1.5, 4.0])}
V = {"w": torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -0.75]]), "b": torch.tensor([1.0, 0.5, -0.25, 0.5])}
STD, SCALE = 0.7, 1.0 / 8.0


def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum((a[k].double() * b[k].double()).sum() for k in a))


MEAN = _dot(Q, V) * SCALE  # 10.625 / 8
SD = STD * math.sqrt(_dot(V, V)) * SCALE


def _gate(seed: int = 0, ledger: Ledger | None = None, secure: bool = False) -> NoisyRelease:
    return NoisyRelease(ledger if ledger is not None else Ledger(), 0.25, NoiseSource(seed, secure=secure))


def _release(gate: NoisyRelease, std: float = STD) -> DeferredSum:
    (h,) = gate.release(SumQuery("q", Q, 1.0, std, deferred=True), label="q")
    assert isinstance(h, DeferredSum)
    return h


# ----------------------------------------------------------------------------- the law of a projection
def normal_ks_pvalue(x: np.ndarray, mean: float, sd: float) -> float:
    """Exact-normal KS test of x ~ N(mean, sd²): KS of z = (x − mean)/sd against N(0, 1) (shape and
    location) and of |z| against the half-normal (twice as sensitive to a wrong sd), Bonferroni."""
    z = (x - mean) / sd
    p_raw = stats.kstest(z, "norm").pvalue
    p_folded = stats.kstest(np.abs(z), stats.halfnorm.cdf).pvalue
    return float(min(1.0, 2 * min(p_raw, p_folded)))


def test_projection_has_the_law_of_the_projected_full_noise_vector() -> None:
    assert abs(MEAN) > 4 * SD  # a projection that dropped or misplaced the mean would be rejected
    n = 12_000
    gate = _gate(1)
    proj = np.array([gate.project(_release(gate).scaled(SCALE), V) for _ in range(n)])
    assert normal_ks_pvalue(proj, MEAN, SD) > 1e-4
    # Power: the same test rejects σ off by ±10% (folded KS: √n·D ≈ 5.0 and 5.6, p ~ 1e-21).
    for wrong in (0.9 * SD, 1.1 * SD):
        assert normal_ks_pvalue(proj, MEAN, wrong) < 1e-6
    # The straightforward path: draw the whole Z, then project; same law (two-sample KS).
    m = 6_000
    full = np.array([_dot(gate.materialize(_release(gate).scaled(SCALE)), V) for _ in range(m)])
    assert normal_ks_pvalue(full, MEAN, SD) > 1e-4
    assert stats.ks_2samp(proj, full).pvalue > 1e-4
    assert gate.ledger.releases == n + m  # every handle was one recorded release


def test_scalar_draw_is_float64_and_exact_in_std() -> None:
    src = NoiseSource(5)
    z = np.array([src.scalar(1.0) for _ in range(200)])
    assert np.mean(z.astype(np.float32).astype(np.float64) != z) > 0.9  # not float32 values
    # std enters exactly: same generator state, std 1 vs std 3
    a, b = NoiseSource(9).scalar(1.0), NoiseSource(9).scalar(3.0)
    assert b == 3.0 * a


def test_secure_mode_draws_the_scalar_from_the_secure_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    src = NoiseSource(0, secure=True)
    z = np.array([src.scalar(0.6) for _ in range(8_000)])
    assert_gaussian_std(z, 0.6, "secure scalar")  # accepts 0.6, rejects 0.48 and 0.75
    assert NoiseSource(0, secure=True).scalar(1.0) != NoiseSource(0, secure=True).scalar(1.0)
    with pytest.raises(RuntimeError, match="no state"):
        src.state()  # no seeded generator behind it
    # The secure scalar is a function of the OS CSPRNG's bytes only, never of the seed: with
    # os.urandom replaced by a fixed byte stream, two sources with different seeds agree.
    import os

    reads: list[int] = []

    def fixed_bytes(n: int) -> bytes:
        reads.append(n)
        return np.random.default_rng(len(reads)).bytes(n)

    monkeypatch.setattr(os, "urandom", fixed_bytes)
    a = NoiseSource(0, secure=True).scalar(1.0)
    assert reads
    reads.clear()
    assert NoiseSource(12345, secure=True).scalar(1.0) == a
    reads.clear()
    assert mechanisms.NoiseSource(0).scalar(1.0) != a and not reads  # control: seeded mode reads no OS bytes


# ----------------------------------------------------------------------------- handle life cycle
def test_a_handle_is_projected_at_most_once() -> None:
    gate = _gate()
    h = _release(gate)
    first = gate.project(h.scaled(SCALE), V)
    assert math.isfinite(first)
    for again in (h, h.scaled(SCALE), h.scaled(2.0)):  # rescaled copies share the same noise
        with pytest.raises(RuntimeError, match="already projected"):
            gate.project(again, V)
    with pytest.raises(RuntimeError, match="cannot be materialized"):
        gate.materialize(h)


def test_a_materialized_handle_projects_its_own_vector_without_drawing() -> None:
    gate = _gate(2)
    h = _release(gate).scaled(SCALE)
    full = gate.materialize(h)
    state = gate.noise.drawn
    p1, p2 = gate.project(h, V), gate.project(h, V)  # post-processing of the drawn vector: repeatable
    assert gate.noise.drawn == state
    assert p1 == p2 == pytest.approx(_dot(full, V), rel=1e-6)
    again = gate.materialize(h)
    assert all(torch.equal(full[k], again[k]) for k in full)
    noise = torch.cat([(full[k] / SCALE - Q[k]).reshape(-1) for k in Q])
    assert float(noise.abs().min()) > 0  # the vector really carries noise


def test_projection_records_nothing_and_draws_one_scalar() -> None:
    event = accounting.gaussian_step_event(STD, 0.25)
    ledger = Ledger.with_plan(event)  # exactly one release allowed
    gate = _gate(3, ledger)
    h = _release(gate)
    before = ledger.to_dict()
    with pytest.raises(BudgetExceededError):
        _release(gate)  # the plan is spent ...
    gate.project(h, V)  # ... yet the projection works: it is not a release
    assert ledger.to_dict() == before and ledger.releases == 1
    ref = NoiseSource(3)
    ref.scalar(1.0)
    assert gate.noise.drawn == ref.drawn == {torch.float64: 1}  # one scalar, not a vector


def test_a_refused_deferred_release_records_and_draws_nothing() -> None:
    ledger = Ledger.with_plan(accounting.gaussian_step_event(2.0 * STD, 0.25))
    gate = _gate(4, ledger)
    state = gate.noise.drawn
    with pytest.raises(BudgetExceededError, match="not in the privacy plan"):
        gate.release(SumQuery("g", Q, 1.0, STD), SumQuery("q", Q, 1.0, STD, deferred=True), label="x")
    assert ledger.releases == 0 and gate.noise.drawn == state


def test_only_the_issuing_gateway_projects_a_handle() -> None:
    a, b = _gate(5), _gate(6)
    h = _release(a)
    state = b.noise.drawn
    with pytest.raises(ValueError, match="another gateway"):
        b.project(h, V)
    with pytest.raises(ValueError, match="another gateway"):
        b.materialize(h)
    assert b.noise.drawn == state
    a.project(h, V)  # still unconsumed: the refused attempts drew nothing


def test_handle_hides_the_exact_value_in_its_repr() -> None:
    h = _release(_gate())
    assert "tensor" not in repr(h) and repr(h).startswith("DeferredSum(name='q'")


# ----------------------------------------------------------------------------- OSO
def _toy(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] - 0.5 * x[:, 1] > 0).long()
    return x, y


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("clip_lr", [0.0, 0.05])
def test_oso_ledger_is_the_same_with_deferred_and_eager_q_noise(
    clip_lr: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = _toy()

    def run():
        return train(
            _model(),
            (x, y),
            "oso",
            steps=8,
            expected_batch_size=40,
            noise_multiplier=0.9,
            seed=3,
            device="cpu",
            initial_clip=0.5,
            clip_lr=clip_lr,
            lr=0.2,
        )

    deferred = run()
    monkeypatch.setattr(OSOClip, "defer_q_noise", False)
    eager = run()
    for res in (deferred, eager):
        assert res.ledger.matches(res.plan.event()) and res.ledger.releases == 8
        assert res.ledger.by_label() == {"oso/gradient+q": 8}
    assert deferred.ledger.atoms() == eager.ledger.atoms()
    for a, b in zip(deferred.ledger.entries, eager.ledger.entries, strict=False):
        assert [(c[0], c[1]) for c in a.components] == [(c[0], c[1]) for c in b.components]  # names, ν_i
    if clip_lr == 0.0:  # C constant: the sensitivities agree too, so the ledgers are identical
        assert deferred.ledger.to_dict() == eager.ledger.to_dict()


@pytest.mark.parametrize(
    ("rule", "defer", "full_per_step", "scalars_per_step"),
    [("exp", True, 1, 1), ("additive", True, 1, 1), ("exp", False, 2, 0), ("normalized", True, 2, 0)],
)
def test_oso_step_draws_one_full_vector_per_release(
    rule: str, defer: bool, full_per_step: int, scalars_per_step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    draws: list[tuple[int, ...]] = []
    real = NoiseSource.normal

    def counting(self: NoiseSource, like: torch.Tensor, std: float) -> torch.Tensor:
        draws.append(tuple(like.shape))
        return real(self, like, std)

    monkeypatch.setattr(NoiseSource, "normal", counting)
    monkeypatch.setattr(OSOClip, "defer_q_noise", defer)
    model = _model()
    x, y = _toy(64)
    shapes = sorted(tuple(p.shape) for p in model.parameters())
    assert len(shapes) == 4
    gate = gateway(0.5, seed=1)
    steps = 3
    run_strategy_steps(
        OSO(rule=rule), model, x, y, steps=steps, release=gate, noise_multiplier=1.0, expected_batch_size=32.0
    )
    full = [s for s in draws if s != ()]  # a sum's tensors are drawn as one vector (the same normals, in order)
    assert sum(math.prod(s) for s in full) == sum(math.prod(s) for s in shapes) * full_per_step * steps
    assert len(full) in (full_per_step * steps, len(shapes) * full_per_step * steps)
    # the scalar of q̃_{t−1} is drawn from step 2 on (q̃_0 = 0)
    assert sum(s == () for s in draws) == scalars_per_step * (steps - 1)
    assert gate.ledger.releases == steps  # step T's release is recorded although never projected


def _regression() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(60, 5)
    return x, 3.0 + x @ torch.randn(5, 1)


def _batches(n: int):
    """Random half-batches (fixed per step): consecutive q-sums then differ clearly."""
    g, cache = torch.Generator().manual_seed(1), {}

    def batch(t: int) -> torch.Tensor:
        if t not in cache:
            cache[t] = torch.nonzero(torch.rand(n, generator=g) < 0.5).squeeze(1)
        return cache[t]

    return batch


def _oso_with_negligible_noise(rule: str, defer: bool, monkeypatch: pytest.MonkeyPatch):
    """ν = 1e-6: q̃_t's noise (σ_q‖g̃‖/L) is ~1e-6 of g̃ᵀQ_t/L, so the C rule is deterministic."""
    monkeypatch.setattr(OSOClip, "defer_q_noise", defer)
    x, y = _regression()
    torch.manual_seed(0)
    gate = gateway(0.5, seed=3)
    strat = OSO(lr=1.0, initial_clip=2.0, clip_lr=0.1, lr_lr=0.05, momentum=0.7, rule=rule)
    out = run_strategy_steps(
        strat,
        nn.Linear(5, 1),
        x,
        y,
        steps=12,
        release=gate,
        loss="mse",
        noise_multiplier=1e-6,
        expected_batch_size=30.0,
        batches=_batches(60),
    )
    return gate, out


@pytest.mark.parametrize("rule", ["exp", "additive"])
def test_oso_projection_uses_the_previous_q_sum_the_new_gradient_and_one_over_L(
    rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """g_dot_q at step t+1 is g̃_{t+1}ᵀQ_t/L with g̃_{t+1} the released gradient / L: a projection on
    the momentum buffer, on Q_{t+1} or without the 1/L would be off by far more than 1e-4."""
    gate, out = _oso_with_negligible_noise(rule, True, monkeypatch)
    L, mu = 30.0, 0.7
    assert out.metrics[0]["g_dot_q"] == 0.0
    m = {k: v / L for k, v in gate.calls[0].outputs[0].items()}  # heavy-ball buffer m_1 = g̃_1
    for t in range(1, len(out.metrics)):
        g_next = {k: v / L for k, v in gate.calls[t].outputs[0].items()}
        m = {k: mu * m[k] + g_next[k] for k in m}
        q_prev = {k: v / L for k, v in gate.calls[t - 1].queries[1].value.items()}
        expected = _dot(g_next, q_prev)
        wrong = [
            _dot(g_next, {k: v / L for k, v in gate.calls[t].queries[1].value.items()}),  # Q_{t+1}
            _dot(m, q_prev),  # the momentum buffer instead of g̃_{t+1}
            expected * L,
        ]  # 1/L forgotten
        assert out.metrics[t]["g_dot_q"] == pytest.approx(expected, rel=1e-4, abs=1e-9)
        assert all(abs(w - expected) > 1e-2 * abs(expected) for w in wrong)
    assert isinstance(out.state["prev_q"], DeferredSum)


@pytest.mark.parametrize("rule", ["exp", "additive"])
def test_oso_clip_trajectory_is_the_eager_one(rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, deferred = _oso_with_negligible_noise(rule, True, monkeypatch)
    _, eager = _oso_with_negligible_noise(rule, False, monkeypatch)
    signs = [math.copysign(1.0, m["g_dot_q"]) for m in deferred.metrics[1:]]
    assert 1.0 in signs and -1.0 in signs  # a trajectory that goes both ways
    for a, b in zip(deferred.metrics, eager.metrics, strict=True):
        assert a["g_dot_q"] == pytest.approx(b["g_dot_q"], rel=1e-4, abs=1e-9)
        assert a["clip"] == pytest.approx(b["clip"], rel=1e-4 if rule == "additive" else 1e-12)
    assert deferred.state["clip"] == pytest.approx(eager.state["clip"], rel=1e-4)


def test_oso_still_trains() -> None:
    x, y = _toy(400, seed=2)
    model = _model(1)
    with torch.no_grad():
        loss0 = float(nn.functional.cross_entropy(model(x), y))
    res = train(
        model,
        (x, y),
        "oso",
        steps=60,
        expected_batch_size=80,
        noise_multiplier=1.0,
        seed=0,
        device="cpu",
        lr=0.5,
        initial_clip=1.0,
    )
    model.load_state_dict({**model.state_dict(), **res.final_params})
    with torch.no_grad():
        assert float(nn.functional.cross_entropy(model(x), y)) < 0.7 * loss0
    assert res.history[-1]["clip"] != 1.0  # C moved, through the projected statistic


# ----------------------------------------------------------------------------- mutants on the deferred path
def test_q_noise_removed_mutant_makes_the_projection_exact() -> None:
    exact = _dot(Q, V) * SCALE
    with q_noise_removed():
        gate = _gate(7)
        _, h = gate.release(
            SumQuery("gradient", Q, 1.0, 2.0), SumQuery("clip_hypergradient", Q, 1.0, STD, deferred=True), label="x"
        )
        assert gate.project(h.scaled(SCALE), V) == pytest.approx(exact, rel=1e-6)
        _, h = gate.release(
            SumQuery("gradient", Q, 1.0, 2.0), SumQuery("clip_hypergradient", Q, 1.0, STD, deferred=True), label="x"
        )
        full = gate.materialize(h)
        assert all(torch.equal(full[k], Q[k]) for k in Q)
    gate = _gate(7)  # control: without the mutant the projection is noisy
    _, h = gate.release(
        SumQuery("gradient", Q, 1.0, 2.0), SumQuery("clip_hypergradient", Q, 1.0, STD, deferred=True), label="x"
    )
    assert abs(gate.project(h.scaled(SCALE), V) - exact) > 1e-3 * SD


def test_noise_scaled_mutant_scales_the_scalar_draw() -> None:
    a = NoiseSource(11).scalar(2.0)
    with noise_scaled(0.25):
        b = NoiseSource(11).scalar(2.0)
    assert b == pytest.approx(0.25 * a, rel=1e-15) and a != 0


def test_first_query_only_accounting_mutant_handles_deferred_queries() -> None:
    gate = _gate(8)
    nu_g, nu_q = 1.1, 7.5
    g, h = _release_accounting_first_query_only(
        gate, SumQuery("gradient", Q, 1.0, nu_g), SumQuery("clip_hypergradient", Q, 1.0, nu_q, deferred=True), label="x"
    )
    (entry,) = gate.ledger.entries
    assert entry.event == accounting.gaussian_step_event(nu_g, 0.25)  # the bug: ν_g only
    assert isinstance(g, dict) and isinstance(h, DeferredSum) and h.std == nu_q
    assert math.isfinite(gate.project(h, V))


@pytest.mark.parametrize("secure", [False, True])
def test_a_tiny_direction_still_gets_its_noise(secure: bool) -> None:
    """‖v‖² is formed in float64, as the mean: in float32 it underflowed to 0 for |v_i| ≲ 4e-23 and the
    projection released the exact ⟨S, v⟩ with no noise (found in review). The spread must be ν‖v‖."""
    gate = NoisyRelease(Ledger(), 0.01, NoiseSource(5, secure=secure))
    S = torch.tensor([3.0, -1.0, 2.0, 5.0])
    v = torch.tensor([1e-23, 2e-23, -1e-23, 1e-23])
    exact = float((S.double() * v.double()).sum())
    spread = 7.0 * float(v.double().norm())
    z = np.array([(gate.project(gate.release(SumQuery("q", S, 1.0, 7.0, deferred=True), label="q")[0], v) - exact)
                  / spread for _ in range(400)])  # fmt: skip
    assert abs(z.std() - 1.0) < 0.15 and abs(z.mean()) < 0.25  # 0 before (no noise); 4σ bands at n = 400
