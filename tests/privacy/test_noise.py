"""The noise actually added, for every private strategy and every query it releases.

Set-up: a bias-free linear model on all-zero inputs (``zero_grad_problem``), so every
per-example gradient is exactly 0 and each released gradient sum is pure noise; the
quantile count's exact value is B/2. The gateway is the real ``NoisyRelease`` that also
records each call (``RecordingRelease``), so noise = output − exact value. Each σ is
recomputed here from the configuration (ν, C, the split rules), not read from the
strategy, and ``assert_gaussian_std`` accepts it while rejecting 0.8σ and 1.25σ.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    RecordingRelease,
    assert_gaussian_std,
    flat,
    gateway,
    gaussian_std_accepts,
    run_strategy_steps,
    zero_grad_problem,
)

import dptune
from dptune import train
from dptune.release.privatizers import MIN_CLIP
from dptune.strategies import make_strategy

pytestmark = pytest.mark.usefixtures("one_thread")

NU = 1.3
L = 32.0  # expected batch size of the stub runs (the batch itself is the whole zero data)
Q = 0.5


def joint_split(nu: float, nu_aux: float) -> float:
    """ν_g with (ν_g⁻² + ν_aux⁻²)^(−½) = ν, recomputed here."""
    return 1.0 / math.sqrt(nu**-2 - nu_aux**-2)


def first_gradient_noise(gate: RecordingRelease, call: int = 0) -> torch.Tensor:
    return gate.noise_of(call, 0)


# ----------------------------------------------------------------------------- the helper itself
def test_variance_test_accepts_the_truth_and_rejects_wrong_sigma() -> None:
    z = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 0.37
    assert_gaussian_std(z, 0.37, "synthetic")
    assert not gaussian_std_accepts(z, 0.8 * 0.37)
    assert not gaussian_std_accepts(z, 1.25 * 0.37)
    assert not gaussian_std_accepts(z + 0.1, 0.37)  # a biased release is rejected too
    with pytest.raises(AssertionError, match="no power"):
        assert_gaussian_std(z[:20], 0.37)  # too few samples to tell 0.8σ from σ: refused


# ----------------------------------------------------------------------------- DP-SGD family
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dpsgd_gradient_noise_and_update(momentum: float) -> None:
    clip, lr = 0.7, 0.5
    model, x, y = zero_grad_problem()
    gate = gateway(Q)
    strat = make_strategy("dpsgd", lr=lr, clip=clip, momentum=momentum)
    out = run_strategy_steps(strat, model, x, y, steps=3, release=gate, noise_multiplier=NU, expected_batch_size=L)
    noise = torch.cat([first_gradient_noise(gate, t) for t in range(3)])
    assert_gaussian_std(noise, NU * clip, "dpsgd gradient")
    # The update consumes the noisy release: θ_t = θ_{t−1} − lr·m_t, m_t = μ m_{t−1} + g̃_t.
    theta = flat(dict(model.named_parameters()))
    m = torch.zeros_like(theta)
    for t in range(3):
        m = momentum * m + flat(gate.calls[t].outputs[0]) / L
        theta = theta - lr * m
        torch.testing.assert_close(flat(out.params_history[t]), theta, rtol=1e-5, atol=1e-7)


def test_dpgd_full_batch_noise() -> None:
    model, x, y = zero_grad_problem()
    gate = gateway(1.0)
    strat = make_strategy("dpgd", lr=0.1)  # unit clipping, momentum 0.9 (Panda et al.)
    run_strategy_steps(strat, model, x, y, steps=2, release=gate, noise_multiplier=NU)
    assert gate.ledger.entries[0].event.__class__.__name__ == "GaussianDpEvent"  # q = 1: no sampling
    assert_gaussian_std(torch.cat([first_gradient_noise(gate, t) for t in range(2)]), NU * 1.0, "dpgd gradient")


def test_dpadam_noise_and_first_update() -> None:
    clip, lr, eps = 0.5, 1e-3, 1e-8
    model, x, y = zero_grad_problem()
    gate = gateway(Q)
    out = run_strategy_steps(
        make_strategy("dpadam", lr=lr, clip=clip),
        model,
        x,
        y,
        steps=1,
        release=gate,
        noise_multiplier=NU,
        expected_batch_size=L,
    )
    assert_gaussian_std(first_gradient_noise(gate), NU * clip, "dpadam gradient")
    g = flat(gate.calls[0].outputs[0]) / L
    # First Adam step with bias correction: m̂ = g̃, v̂ = g̃² ⇒ Δθ = −lr·g̃/(|g̃| + ε).
    expected = flat(dict(model.named_parameters())) - lr * g / (g.abs() + eps)
    torch.testing.assert_close(flat(out.params), expected, rtol=1e-5, atol=1e-9)


def test_adamwosm_noise_and_effective_step_size() -> None:
    clip, alpha = 0.5, 1e-3
    model, x, y = zero_grad_problem()
    gate = gateway(Q)
    out = run_strategy_steps(
        make_strategy("adamwosm", clip=clip, alpha=alpha),
        model,
        x,
        y,
        steps=1,
        release=gate,
        noise_multiplier=NU,
        expected_batch_size=L,
    )
    assert_gaussian_std(first_gradient_noise(gate), NU * clip, "adamwosm gradient")
    ess = alpha / (NU * clip / L + 1e-8)
    g = flat(gate.calls[0].outputs[0]) / L
    torch.testing.assert_close(flat(out.params), flat(dict(model.named_parameters())) - ess * g, rtol=1e-5, atol=1e-9)


def test_adadp_noise_on_both_half_steps() -> None:
    clip, lr = 0.8, 0.05
    model, x, y = zero_grad_problem()
    gate = gateway(Q)
    out = run_strategy_steps(
        make_strategy("adadp", lr=lr, clip=clip, reject=False),
        model,
        x,
        y,
        steps=2,
        release=gate,
        noise_multiplier=NU,
        expected_batch_size=L,
    )
    assert len(gate.calls) == 2  # one release per half step
    assert_gaussian_std(torch.cat([first_gradient_noise(gate, t) for t in range(2)]), NU * clip, "adadp gradient")
    theta0 = flat(dict(model.named_parameters()))
    g0, g1 = (flat(gate.calls[t].outputs[0]) / L for t in range(2))
    torch.testing.assert_close(flat(out.params_history[0]), theta0 - lr / 2 * g0, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(flat(out.params_history[1]), theta0 - lr / 2 * (g0 + g1), rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------- adaptive clipping
def test_quantile_gradient_and_count_noise() -> None:
    """Gradient noise ν_g·C_t and count noise σ_b = L/20 (Andrew et al. default), over many
    steps; C_t is recomputed from the NOISY count, which also checks the geometric rule."""
    c0, eta, gamma, steps = 0.1, 0.2, 0.5, 400
    model, x, y = zero_grad_problem(10, 4, 16)  # 40 parameters, B = 16
    gate = gateway(Q)
    strat = make_strategy("quantile", initial_clip=c0, clip_lr=eta, target_quantile=gamma)
    out = run_strategy_steps(strat, model, x, y, steps=steps, release=gate, noise_multiplier=NU, expected_batch_size=L)
    sigma_b = L / 20
    nu_g = joint_split(NU, 2 * sigma_b)
    counts, grads, clip = [], [], c0
    for t, call in enumerate(gate.calls):
        assert float(call.queries[1].value) == pytest.approx(16 / 2)  # Σ(1[0 ≤ C] − ½) = B/2
        counts.append(float(gate.noise_of(t, 1)))
        assert out.metrics[t]["clip"] == pytest.approx(clip, rel=1e-9)
        grads.append(gate.noise_of(t, 0) / clip)
        b = float(call.outputs[1]) / L + 0.5
        clip = max(clip * math.exp(-eta * (b - gamma)), MIN_CLIP)  # the rule's floor (docs/privacy.md, item 16)
    assert_gaussian_std(np.array(counts), sigma_b, "quantile count")
    assert_gaussian_std(torch.cat(grads), nu_g, "quantile gradient / C_t")


def test_oso_gradient_and_q_noise() -> None:
    c0 = 0.1
    model, x, y = zero_grad_problem()
    gate = gateway(Q)
    run_strategy_steps(
        make_strategy("oso", initial_clip=c0),
        model,
        x,
        y,
        steps=1,
        release=gate,
        noise_multiplier=NU,
        expected_batch_size=L,
    )
    nu_q = NU / math.sqrt(1 - 1.01**-2)  # the 1% rule, ≈ 7.124ν
    nu_g = joint_split(NU, nu_q)
    assert nu_g == pytest.approx(1.01 * NU)
    assert_gaussian_std(gate.noise_of(0, 0), nu_g * c0, "oso gradient")
    assert_gaussian_std(gate.noise_of(0, 1), nu_q * 1.0, "oso q-query")  # unit rows: sensitivity 1
    # The two noises are independent draws (not one vector reused).
    assert abs(float(np.corrcoef(gate.noise_of(0, 0), gate.noise_of(0, 1))[0, 1])) < 0.1


def test_oso_explicit_q_noise_multiplier() -> None:
    model, x, y = zero_grad_problem()
    gate = gateway(Q)
    run_strategy_steps(
        make_strategy("oso", q_noise_multiplier=20.0, initial_clip=0.3),
        model,
        x,
        y,
        steps=1,
        release=gate,
        noise_multiplier=NU,
        expected_batch_size=L,
    )
    assert_gaussian_std(gate.noise_of(0, 1), 20.0, "oso q-query")
    assert_gaussian_std(gate.noise_of(0, 0), joint_split(NU, 20.0) * 0.3, "oso gradient")


# ----------------------------------------------------------------------------- through train()
def test_noise_through_train_matches_and_is_what_moves_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    gates: list[RecordingRelease] = []

    class Spy(RecordingRelease):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            gates.append(self)

    monkeypatch.setattr(sys.modules["dptune.train"], "NoisyRelease", Spy)  # the module, not the function
    model, x, y = zero_grad_problem(20, 10, 100)
    theta0 = flat(dict(model.named_parameters()))
    lr, clip, nu, steps = 0.3, 2.0, 0.9, 10
    res = train(
        model,
        (x, y),
        "dpsgd",
        steps=steps,
        expected_batch_size=25,
        noise_multiplier=nu,
        lr=lr,
        clip=clip,
        momentum=0.0,
        device="cpu",
        seed=5,
    )
    (gate,) = gates
    assert len(gate.calls) == steps
    noise = torch.cat([gate.noise_of(t, 0) for t in range(steps)])
    assert_gaussian_std(noise, nu * clip, "train dpsgd gradient")
    total = sum(flat(c.outputs[0]) for c in gate.calls)
    torch.testing.assert_close(flat(res.final_params), theta0 - lr * total / 25, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- where noise is drawn
NOISE_PATTERN = re.compile(
    r"torch\.randn|randn_like|torch\.normal|\.normal_\(|\.normal\(|standard_normal|multivariate_normal|random\.gauss|normalvariate"
)
# Gaussian draws that are not privacy noise, per file (path relative to src/dptune). Each entry
# is reviewed: adding one means arguing why it is not a release of private data.
ALLOWED = {
    "release/mechanisms.py": re.compile(r".*"),  # THE gateway
    # synthetic canary/background rows of the privacy audit: data generation, not a release
    "audit/harness.py": re.compile(r"g = rng\.normal\(size=\(background, background_dim\)\)"),
    # the cosine-similarity diagnostic (Galli Fig. 1 style) simulates g̃ = Σclip + νC·z to study C;
    # its output is a non-private analysis of the data by design, never a training release
    "report/diagnostics.py": re.compile(r"z = noise\.normal\(true, 1\.0\)"),
    # a data-parallel rank: rank 0 calls the gateway's own NoiseSource.normal (drawn in mechanisms.py)
    # and broadcasts it; the other ranks draw nothing (docs/privacy.md, item 10)
    "distributed.py": re.compile(r"z = super\(\)\.normal\(like, std\) if dist\.get_rank\(\) == 0 else"),
}
ALLOWED_ANYWHERE = re.compile(r"nn\.init\.|init\.(normal_|trunc_normal_|kaiming|xavier)")  # weight init


def test_privacy_noise_is_only_drawn_in_mechanisms() -> None:
    root = Path(dptune.__file__).resolve().parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if not NOISE_PATTERN.search(code):
                continue
            if rel in ALLOWED and ALLOWED[rel].search(code):
                continue
            if ALLOWED_ANYWHERE.search(code):
                continue
            offenders.append(f"{rel}:{lineno}: {line.strip()}")
    assert not offenders, "Gaussian noise drawn outside mechanisms.py:\n" + "\n".join(offenders)
    # And the gateway really is where it happens.
    assert "def _normal_pairs_np" in (root / "release" / "mechanisms.py").read_text()  # Box–Muller on integer bits
