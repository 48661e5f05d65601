"""DP zeroth-order optimisation (``dpzo`` = chain(ZerothOrderClip, SGD); Tang et al. 2024, Panda
et al. 2024 Table 14).

* the released scalar's noise has std νC (a KS test accepts νC and rejects 0.9νC and 1.1νC);
* the ledger equals the plan, and ε is dp_accounting's on the textbook DP-SGD event;
* clipping: one example with a huge loss difference moves the released sum by at most C, a
  non-finite one by 0; the query's declared sensitivity is C;
* the step is θ − η·(s/L)·z with s the clipped sum of hand-computed central differences along z;
* the directions have their own stream: the noise stream serves one scalar per step;
* DP-ZO lowers the loss of a small logistic regression; a study arm trains within its plan;
* per-example isolation: a loss that mixes examples (centred, in-batch contrastive) is refused
  before the first release, a per-example user loss is not;
* dropout: the θ + μz and θ − μz passes draw the same masks;
* the directions do not depend on the data: one seed on two datasets steps along parallel lines.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import CaptureRelease, RecordingRelease, params_of, run_plan, run_strategy_steps, zero_grad_problem
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from scipy import stats
from torch import nn
from tune_helpers import make_study

import dptune
from dptune import accounting
from dptune.gradients.oracle import GradientOracle
from dptune.release.context import StepContext
from dptune.release.ledger import Ledger
from dptune.release.mechanisms import NoiseSource
from dptune.release.privatizers import ZerothOrderClip
from dptune.release.sampling import stream_seed
from dptune.strategies import DPZO, make_strategy

pytestmark = pytest.mark.usefixtures("one_thread")

NU, CLIP, L = 1.3, 0.7, 4.0
# KS tells σ from 1.1σ at p < 1e-6 from ~1e4 draws (here: p ≈ 3e-8 for 1.1σ, 3e-10 for 0.9σ, 0.57 for σ).
KS_SAMPLES = 12_000


def _logistic(n: int = 400, d: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, generator=g) > 0).long()
    torch.manual_seed(seed)
    return nn.Linear(d, 2, bias=False), x, y


def _full_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    return float(nn.functional.cross_entropy(x @ params["weight"].T, y))


def _ctx(model: nn.Module, x, y, release, nu: float = NU, n: int | None = None) -> StepContext:
    n = int(y.shape[0]) if n is None else n
    run = run_plan(nu, release.sampling_rate, float(n) * release.sampling_rate, 1)
    return StepContext(t=1, x=x, y=y, oracle=GradientOracle(model), release=release, run=run)


@cache
def _released_noise() -> tuple[float, ...]:
    """KS_SAMPLES released scalars of ZerothOrderClip(C) on a problem where every finite
    difference is exactly 0 (zero inputs: the loss does not depend on θ): pure noise."""
    model, x, y = zero_grad_problem(inputs=2, classes=2, n=8)
    q = L / 8
    plan = dp_event.SelfComposedDpEvent(accounting.gaussian_step_event(NU, q), KS_SAMPLES)
    gw = RecordingRelease(Ledger.with_plan(plan), q, NoiseSource(11))
    priv = ZerothOrderClip(CLIP)
    state = priv.init(run_plan(NU, q, L, KS_SAMPLES))
    params = params_of(model)
    ctx = _ctx(model, x[:4], y[:4], gw, n=8)
    out = []
    for _ in range(KS_SAMPLES):
        released, state, info = priv.privatize(params, state, ctx, lr=0.1, label="dpzo")
        out.append(float(gw.calls[-1].outputs[0]))
        assert info["zo_derivative"] == out[-1] / L and released.divisor == L
    assert all(float(c.queries[0].value) == 0.0 for c in gw.calls)  # the exact sums are 0: outputs are noise
    assert gw.ledger.matches(plan)
    return tuple(out)


@pytest.mark.parametrize(("factor", "accept"), [(1.0, True), (0.9, False), (1.1, False)])
def test_released_scalar_noise_has_std_nu_c(factor: float, accept: bool) -> None:
    """N(0, (νC)²) — not (νC/L)², not a vector: a KS test accepts νC and rejects σ off by 10 %."""
    p = stats.kstest(_released_noise(), stats.norm(scale=factor * NU * CLIP).cdf).pvalue
    assert (p > 1e-3) if accept else (p < 1e-6), p


def test_ledger_equals_the_plan_and_epsilon_is_dp_sgds() -> None:
    model, x, y = _logistic(n=120)
    r = dptune.train(
        model, (x, y), "dpzo", steps=9, expected_batch_size=40, noise_multiplier=1.5, seed=1, device="cpu",
        accountant="rdp", lr=0.05,
    )  # fmt: skip
    assert r.ledger.releases == 9 and r.ledger.matches(r.plan.event())
    assert {e.components for e in r.ledger.entries} == {(("zo_directional_derivative", 1.5, 1.0),)}
    ref = rdp.RdpAccountant().compose(
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(40 / 120, dp_event.GaussianDpEvent(1.5)), 9)
    )
    assert r.epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    # Calibrated to a target ε: the same ν as DP-SGD's for the same q and T (the same event).
    a = dptune.plan_run(make_strategy("dpzo"), 120, expected_batch_size=40, steps=9, target_epsilon=2.0, delta=1e-5)
    b = dptune.plan_run(make_strategy("dpsgd"), 120, expected_batch_size=40, steps=9, target_epsilon=2.0, delta=1e-5)
    assert a.noise_multiplier == b.noise_multiplier and a.event() == b.event()


def _released_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float = CLIP) -> float:
    """The exact (noise-free) sum ZerothOrderClip releases on (x, y), with a fresh state: the
    stub gateway's direction stream is fixed, so every call uses the same z."""
    gw = CaptureRelease()
    priv = ZerothOrderClip(clip)
    priv.privatize(params_of(model), priv.init(run_plan(NU, 1.0, 1.0, 1)), _ctx(model, x, y, gw), lr=0.1, label="t")
    (call,) = gw.calls
    (query,) = call.queries
    assert query.sensitivity == clip and query.noise_multiplier == NU
    return float(query.value)


def test_an_example_with_a_huge_loss_difference_contributes_at_most_c() -> None:
    model, x, y = _logistic(n=30)
    huge = x[:1] * 1e4  # its loss moves by ~1e4·|z·x| between θ + μz and θ − μz
    alone = _released_sum(model, huge, y[:1])
    assert abs(alone) == CLIP  # clipped to exactly ±C
    others = _released_sum(model, x[1:], y[1:])
    both = _released_sum(model, torch.cat([huge, x[1:]]), y)
    assert abs(both - others) <= CLIP * (1 + 1e-12)
    assert abs(others) <= 29 * CLIP
    # A non-finite loss (inf input) contributes 0, not NaN: the sum stays the others'.
    bad = torch.full_like(x[:1], math.inf)
    assert _released_sum(model, torch.cat([bad, x[1:]]), y) == others


def test_the_step_follows_hand_computed_central_differences_along_z() -> None:
    """θ₁ = θ₀ − η·(s/L)·z with s = Σ clip_C((ℓ_i(θ₀ + μz) − ℓ_i(θ₀ − μz)) / 2μ), z ~ N(0, I)
    from the direction stream, losses computed here with plain torch (noise-free gateway)."""
    model, x, y = _logistic(n=50)
    lr, mu, clip = 0.3, 1e-2, 0.4
    gw = CaptureRelease()
    run = run_strategy_steps(
        DPZO(lr=lr, clip=clip, perturbation=mu), model, x, y, steps=1, release=gw, expected_batch_size=25
    )
    w0 = params_of(model)["weight"]
    z = NoiseSource(stream_seed(0, "zo-directions")).normal(w0, 1.0)  # the stub's direction stream
    lp = nn.functional.cross_entropy(x @ (w0 + mu * z).T, y, reduction="none").double()
    lm = nn.functional.cross_entropy(x @ (w0 - mu * z).T, y, reduction="none").double()
    s = float(((lp - lm) / (2 * mu)).clamp(-clip, clip).sum())
    assert float(gw.calls[0].queries[0].value) == pytest.approx(s, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(run.params["weight"], w0 - lr * (s / 25) * z, rtol=1e-5, atol=1e-7)


def test_directions_do_not_consume_the_noise_stream() -> None:
    """One float64 scalar of privacy noise per step and nothing else: z comes from its own
    stream, so the noise of a DP-ZO run is drawn as for any one-scalar release."""
    model, x, y = _logistic(n=60)
    r = dptune.train(
        model, (x, y), "dpzo", steps=5, expected_batch_size=20, noise_multiplier=1.0, seed=3, device="cpu"
    )  # fmt: skip
    assert r.ledger.releases == 5
    again = dptune.train(
        _logistic(n=60)[0], (x, y), "dpzo", steps=5, expected_batch_size=20, noise_multiplier=1.0, seed=3,
        device="cpu",
    )  # fmt: skip
    torch.testing.assert_close(again.final_params, r.final_params, rtol=0, atol=0)  # seeded: reproducible
    other = dptune.train(
        _logistic(n=60)[0], (x, y), "dpzo", steps=5, expected_batch_size=20, noise_multiplier=1.0, seed=4,
        device="cpu",
    )  # fmt: skip
    assert not torch.equal(other.final_params["weight"], r.final_params["weight"])
    # The gateway's noise stream served exactly one float64 normal per step.
    from dptune.train import open_run

    ledger, gw, _ = open_run(r.plan, seed=3, device=torch.device("cpu"), secure_mode=False, run_id="")
    priv = ZerothOrderClip()
    state = priv.init(run_plan(1.0, 1 / 3, 20.0, 5))
    ctx = _ctx(model, x[:20], y[:20], gw, nu=1.0, n=60)
    for _ in range(5):
        _, state, _ = priv.privatize(params_of(model), state, ctx, lr=1e-3, label="dpzo")
    assert gw.noise.drawn == {torch.float64: 5} and ledger.releases == 5


def test_dpzo_lowers_the_loss_on_a_convex_problem() -> None:
    model, x, y = _logistic()
    before = _full_loss(params_of(model), x, y)
    r = dptune.train(
        model, (x, y), "dpzo", steps=300, expected_batch_size=100, noise_multiplier=1.0, seed=1, device="cpu",
        lr=0.1, eval_data=(x, y), eval_every=100,
    )  # fmt: skip
    after = _full_loss(r.final_params, x, y)
    assert after < 0.5 * before, (before, after)
    assert r.best_metric is not None and r.best_metric > 0.9
    assert r.ledger.matches(r.plan.event())
    assert all(row["clip"] == 1.0 and math.isfinite(row["zo_derivative"]) for row in r.history)


def test_a_study_with_a_dpzo_arm_trains_within_its_plan(tmp_path: Path) -> None:
    from dptune.tune import TrainingSpec, run_study

    _, x, y = _logistic(n=200)
    study = make_study(
        (x[:150], y[:150], x[150:], y[150:]),
        strategy="dpzo",
        space={"lr": [0.03, 0.1]},
        training=TrainingSpec(steps=10, expected_batch_size=30),
        name="dpzo",
    )
    out = run_study(study, tmp_path / "s", progress=False)
    assert out.complete and out.ledger_matches_plan and out.counts == {"done": 2}


# ----------------------------------------------------------------------------- per-example isolation
def _centred(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A baseline-subtracted loss ℓ_i − mean_j ℓ_j: shape [B], but every row depends on the batch."""
    loss = nn.functional.cross_entropy(out, y, reduction="none")
    return loss - loss.mean()


def _in_batch_contrastive(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """InfoNCE with the other examples of the batch as negatives."""
    z = nn.functional.normalize(out, dim=1)
    return nn.functional.cross_entropy(z @ z.T * 10, torch.arange(out.shape[0]), reduction="none")


@pytest.mark.parametrize("fn", [_centred, _in_batch_contrastive])
def test_a_loss_that_mixes_examples_only_ever_sees_one(fn) -> None:
    """The sensitivity C holds only if ℓ_i depends on example i alone. A user loss is computed on one
    example at a time (a batch of one, vmapped: own.user_loss), so each row's loss is that example's alone,
    whatever the other rows; before, such losses were caught only on a probed batch."""
    from dptune.own import check_loss, user_loss

    model, x, y = _logistic(n=40)
    check_loss(fn, model, x, y)  # the shape contract alone cannot see it
    oracle = GradientOracle(model, user_loss(fn))
    got = oracle.losses(params_of(model), x, y)
    alone = torch.cat([oracle.losses(params_of(model), x[i : i + 1], y[i : i + 1]) for i in range(3)])
    assert torch.equal(got[:3], alone)
    dptune.train(
        model, (x, y), "dpzo", steps=2, expected_batch_size=20, noise_multiplier=1.0, seed=0, device="cpu", loss=fn
    )


def test_a_per_example_user_loss_passes_the_isolation_check() -> None:
    model, x, y = _logistic(n=60)

    def ce(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, t, reduction="none")

    r = dptune.train(
        model, (x, y), "dpzo", steps=3, expected_batch_size=20, noise_multiplier=1.0, seed=0, device="cpu", loss=ce
    )
    builtin = dptune.train(
        _logistic(n=60)[0], (x, y), "dpzo", steps=3, expected_batch_size=20, noise_multiplier=1.0, seed=0, device="cpu"
    )  # fmt: skip
    torch.testing.assert_close(r.final_params, builtin.final_params)  # the same run as the built-in loss


# ----------------------------------------------------------------------------- dropout
def test_both_perturbed_passes_draw_the_same_dropout_masks() -> None:
    """d_i is a finite difference of ONE function: the θ + μz and θ − μz forwards share their
    dropout masks (MeZO's RNG reset). With z = 0 every d_i is exactly 0; with a real z, d_i is the
    difference of two passes run from the same RNG state."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 10, generator=g)
    y = (x[:, 0] > 0).long()
    params = params_of(model)
    ctx = StepContext(t=1, x=x, y=y, oracle=GradientOracle(model), release=None, run=run_plan(1.0, 1.0, 50.0, 1))
    priv = ZerothOrderClip(clip=100.0, perturbation=1e-2)
    zero = {k: torch.zeros_like(v) for k, v in params.items()}
    assert not priv.differences(params, zero, ctx).any()
    z = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    torch.manual_seed(7)
    got = priv.differences(params, z, ctx)
    after = torch.rand(())  # the stream moved on by one pass's draws

    def pass_(sign: float) -> torch.Tensor:
        torch.manual_seed(7)
        w = {k: v + sign * 1e-2 * z[k] for k, v in params.items()}
        out = torch.func.functional_call(model, w, (x,))
        return nn.functional.cross_entropy(out, y, reduction="none").double()

    ref = ((pass_(1.0) - pass_(-1.0)) / 2e-2).clamp(-100.0, 100.0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # float32 losses / 2μ: ~1e-6; other masks: ~1
    assert torch.equal(after, torch.rand(()))  # ... exactly one pass's draws


# ----------------------------------------------------------------------------- data-independent directions
def test_two_datasets_with_one_seed_step_along_the_same_directions() -> None:
    """θ_{t+1} − θ_t = −η·(s̃_t/L)·z_t is published, so z_t must not depend on the data: runs on two
    different datasets with the same seed (real gateway) move along parallel directions at every step."""
    from dptune.train import open_run

    steps, n = 4, 40
    model, x, y = _logistic(n=n, seed=0)
    _, x2, y2 = _logistic(n=n, seed=1)
    y2 = 1 - y2
    assert int(y.sum()) != int(y2.sum())
    plan = dptune.plan_run(make_strategy("dpzo"), n, expected_batch_size=n, steps=steps, noise_multiplier=1.0)
    deltas = []
    for xs, ys in ((x, y), (x2, y2)):
        _, gw, _ = open_run(plan, seed=5, device=torch.device("cpu"), secure_mode=False, run_id="")
        run = run_strategy_steps(
            DPZO(lr=0.1), model, xs, ys, steps=steps, release=gw, expected_batch_size=n, noise_multiplier=1.0
        )
        history = [params_of(model)["weight"], *(p["weight"] for p in run.params_history)]
        deltas.append([(b - a).flatten().double() for a, b in zip(history, history[1:], strict=False)])
    for t, (a, b) in enumerate(zip(*deltas, strict=True), 1):
        cos = float(a @ b) / float(a.norm() * b.norm())
        assert abs(cos) == pytest.approx(1.0, abs=1e-6), (t, cos)
