"""Privatizers: the only code that reads per-sample gradients. Each turns one step's per-sample gradients
into a *released* value: it clips, builds the sum queries and passes them through the run's gateway
(``NoisyRelease``: the ledger first, then the noise). Everything downstream of ``Released`` (an update rule, a
torch optimizer, your code) is post-processing (jax_privacy's ``chain(privatizer, optimizer)``); a privatizer
adapts its threshold from its own releases only (docs/strategies.md). Every private privatizer makes ONE joint
Gaussian release of multiplier ν per step; the strategy's ``planned_event`` relies on that."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from dptune import accounting, inputs, tree
from dptune.errors import ConfigError, check_positive
from dptune.gradients.norm_bounds import weights_dtype
from dptune.gradients.oracle import PerSampleGrads
from dptune.gradients.persample import rng_state, set_rng_state
from dptune.release.context import RunPlan, StepContext
from dptune.release.hypergradient import RULES, Rule, check_rate, check_rule, horizon_rate, later, rule_step
from dptune.release.mechanisms import DeferredSum, NoiseSource, SumQuery, random_direction, record_nonprivate
from dptune.release.sampling import stream_seed
from dptune.tree import Tensors, dot

MIN_CLIP = 1e-8  # the floor of every C, a user's (refused below) and each rule's: far above float32's subnormals


def check_clip(name: str, value: float) -> None:
    if check_positive(name, value) < MIN_CLIP:
        raise ConfigError(f"{name} must be ≥ {MIN_CLIP:g}, got {value!r}. Fix: a larger C (or scale your loss up).")


def clip_weights(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C/‖g_i‖): the per-sample weights of the clipped sum (Galli eq. 4), float32 at least."""
    # In place on the fresh clamp_min result. ``C / t`` is ``t.reciprocal() * C`` in torch
    # (Tensor.__rdiv__): the same two roundings here.
    w = norms.to(weights_dtype(norms.dtype)).clamp_min(1e-12).reciprocal_().mul_(clip).clamp_(max=1.0)
    return w.masked_fill_(w < torch.finfo(w.dtype).tiny, 0.0)  # subnormal: rounded by far more than 10⁻⁶·w


def clipped_sum(grads: PerSampleGrads, clip: float) -> Tensors:
    """Σ_i clip_C(g_i). Sensitivity C under add/remove. Stacked trials form theirs together (``clipped``)."""
    pre = getattr(grads, "clipped", None)
    got = pre(clip) if pre is not None else None
    return got if got is not None else grads.weighted_sum(clip_weights(grads.norms, clip))


@dataclass
class Released:
    """One step's released gradient, all an update rule may see: ``total`` Σ clip_C(g_i) + N(0, ν²C²I), undivided;
    ``divisor`` the expected batch size L (never the realised one, which is private; None for ``NonPrivate``, whose
    ``total`` is the gradient); ``clip`` the C used; ``noise_std`` ν_g·C (ν_g > ν for OSO's and quantile's split)."""

    total: Tensors
    divisor: float | None
    clip: float | None
    noise_std: float | None = None  # the std of the noise in ``total`` (ν_g·C; None: no noise)
    _gradient: Tensors | None = field(default=None, repr=False)

    @property
    def scale(self) -> float | None:
        """1/L, the factor an update may fold into a fused multiply-add; None: ``total`` is the gradient."""
        return None if self.divisor is None else 1.0 / self.divisor

    def gradient(self) -> Tensors:
        if self._gradient is None:
            self._gradient = self.total if self.divisor is None else tree.scale(self.total, 1.0 / self.divisor)
        return self._gradient


class Privatizer(ABC):
    """Base class. Subclasses are frozen dataclasses of hyperparameters."""

    name: ClassVar[str]
    private: ClassVar[bool] = True
    hyperparameters: ClassVar[tuple[str, ...]] = ()

    def multipliers(self, run: RunPlan) -> tuple[float, ...]:
        """The per-query noise multipliers of one step's joint release, in query order: together
        (Σ ν_i⁻²)^(-1/2) = the run's ν (``RunPlan.released_multiplier``; ``context.snap_noise``
        makes that exact). Raises ConfigError if this privatizer cannot split the run's ν."""
        return (run.noise_multiplier,)

    def validate_run(self, run: RunPlan) -> None:
        """Raise ConfigError if this privatizer cannot run with these run settings."""
        self.multipliers(run)

    def init(self, run: RunPlan) -> dict[str, Any]:
        return {}

    @abstractmethod
    def privatize(
        self, params: Tensors, state: dict[str, Any], ctx: StepContext, *, lr: float, label: str
    ) -> tuple[Released | None, dict[str, Any], dict[str, float]]:
        """Release this step's gradient through ``ctx.publish`` → (released, state, metrics).

        ``lr``: the update rule's current learning rate (public), for rules that scale by it (OSO's additive rule).
        ``label`` prefixes the ledger labels. None: nothing to apply (an empty non-private batch)."""

    def config(self) -> dict[str, Any]:
        return dict(asdict(self))  # type: ignore[call-overload]


@dataclass(frozen=True)
class FixedClip(Privatizer):
    """Σ_{i∈B_t} clip_C(g_i) + N(0, ν²C²I): one Gaussian release of multiplier ν per step."""

    clip: float = 1.0
    name = "fixed"
    hyperparameters = ("clip",)

    def __post_init__(self) -> None:
        check_clip("clip (C)", self.clip)

    def privatize(self, params, state, ctx, *, lr, label):
        (nu,) = self.multipliers(ctx.run)
        (noisy,) = ctx.publish(
            SumQuery("gradient", clipped_sum(ctx.grads(params), self.clip), self.clip, nu), label=f"{label}/gradient"
        )
        return Released(noisy, ctx.run.expected_batch_size, self.clip, nu * self.clip), state, {"clip": self.clip}


@dataclass(frozen=True)
class QuantileClip(Privatizer):
    """Clip at C_t and move C_t geometrically towards the γ-quantile of the gradient norms
    (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021). Per step, on the same batch:
      Σ clip_{C_t}(g_i) + N(0, ν_g² C_t² I)                          (sensitivity C_t)
      b̃_t = (Σ (1[‖g_i‖ ≤ C_t] − ½) + N(0, σ_b²)) / L + ½            (recentred count, sensitivity ½)
      C_{t+1} = C_t · exp(−η_C (b̃_t − γ))
    with ν_g = (ν⁻² − (2σ_b)⁻²)^(−½): the pair is ONE Gaussian mechanism of multiplier ν
    (Andrew et al., Theorem 1). σ_b defaults to L/20 (Andrew et al.'s default)."""

    target_quantile: float = 0.5  # γ
    clip_lr: float = 0.2  # η_C
    initial_clip: float = 1.0  # C₀
    count_noise_std: float | None = None  # σ_b; None → L/20
    name = "quantile"
    hyperparameters = ("target_quantile", "clip_lr", "initial_clip", "count_noise_std")

    def __post_init__(self) -> None:
        if not (0 < self.target_quantile < 1):
            raise ConfigError(f"target_quantile (γ) must lie in (0, 1), got {self.target_quantile!r}.")
        check_positive("clip_lr (η_C)", self.clip_lr)
        check_clip("initial_clip (C₀)", self.initial_clip)
        if self.count_noise_std is not None:
            check_positive("count_noise_std (σ_b)", self.count_noise_std)

    def multipliers(self, run: RunPlan) -> tuple[float, float]:
        """(ν_g, ν_b) for the gradient and the count, with ν_b = 2σ_b (sensitivity ½)."""
        sigma_b = self.count_noise_std if self.count_noise_std is not None else run.expected_batch_size / 20.0
        if run.noise_multiplier >= 2.0 * sigma_b:
            raise ConfigError(
                f"quantile clipping needs ν < 2σ_b, got ν = {run.noise_multiplier:.4g} and σ_b = "
                f"{sigma_b:.4g}: the count query would use the whole budget. Raise "
                "count_noise_std (σ_b), use a larger expected batch size, or spend more ε."
            )
        return accounting.split_noise_multiplier(run.noise_multiplier, 2.0 * sigma_b), 2.0 * sigma_b

    def init(self, run: RunPlan) -> dict[str, Any]:
        nu_g, nu_b = self.multipliers(run)
        return {"clip": self.initial_clip, "nu_g": nu_g, "nu_b": nu_b}

    def privatize(self, params, state, ctx, *, lr, label):
        clip = state["clip"]
        grads = ctx.grads(params)
        unclipped = (grads.norms <= clip).to(torch.float64)
        count = (unclipped - 0.5).sum().reshape(())
        g_sum, b_sum = ctx.publish(
            SumQuery("gradient", clipped_sum(grads, clip), clip, state["nu_g"]),
            SumQuery("unclipped_count", count, 0.5, state["nu_b"]),
            label=f"{label}/gradient+count",
        )
        L, gamma = ctx.run.expected_batch_size, self.target_quantile
        new_clip = later(b_sum, lambda v: max(clip * math.exp(-self.clip_lr * (v[0] / L + 0.5 - gamma)), MIN_CLIP))
        return (
            Released(g_sum, L, clip, state["nu_g"] * clip),
            {**state, "clip": new_clip},
            {"clip": clip, "unclipped_fraction": later(b_sum, lambda v: v[0] / L + 0.5)},
        )


@dataclass(frozen=True)
class OSOClip(Privatizer):
    """OSO-DPSGD's online clipping threshold (Galli et al. 2024, Algorithm 1), typos corrected: C_t moves by the sign of
    g̃_tᵀq̃_{t−1} (``rule``: ``exp`` eq. 20, ``additive`` eq. 13, ``normalized`` eq. 19), q̃ a second query sharing ν
    (Proposition 1; ν_q by the 1% rule). Equations, noise split and typos: docs/strategies.md, "oso". q̃'s noise is
    deferred for ``exp``/``additive`` (``defer_q_noise``; docs/privacy.md, "Deferred noise")."""

    initial_clip: float = 1.0  # C₀
    clip_lr: float | None = None  # ρ_c; None → OSO_LOG_RANGE / T (horizon-aware)
    q_noise_multiplier: float | None = None  # ν_q; None → from relative_increase
    relative_increase: float = 0.01  # allowed increase of ν_g over ν
    rule: Rule = "exp"
    name = "oso"
    # Same algorithm either way (same law of every output); not a hyperparameter. False
    # restores the full q̃ draw (equivalence tests, benchmarks).
    defer_q_noise: ClassVar[bool] = True
    hyperparameters = ("initial_clip", "clip_lr", "q_noise_multiplier", "relative_increase", "rule")

    def __post_init__(self) -> None:
        check_clip("initial_clip (C₀)", self.initial_clip)
        check_rate("clip_lr (ρ_c)", self.clip_lr)
        check_rule(self.rule)
        if self.q_noise_multiplier is not None:
            check_positive("q_noise_multiplier (ν_q)", self.q_noise_multiplier)
        check_positive("relative_increase", self.relative_increase)

    def multipliers(self, run: RunPlan) -> tuple[float, float]:
        """(ν_g, ν_q) for the run's joint per-step multiplier ν."""
        nu = run.noise_multiplier
        nu_q = self.q_noise_multiplier or accounting.oso_q_noise_multiplier(nu, self.relative_increase)
        return accounting.split_noise_multiplier(nu, nu_q), nu_q

    def init(self, run: RunPlan) -> dict[str, Any]:
        nu_g, nu_q = self.multipliers(run)
        return dict(clip=self.initial_clip, nu_g=nu_g, nu_q=nu_q, prev_q=None, clip_lr=horizon_rate(self.clip_lr, run))

    def privatize(self, params, state, ctx, *, lr, label):
        assert ctx.release is not None
        if state["prev_q"] is not None and self.rule == "additive" and not math.isfinite(lr):
            # Checked before this step's release: the run stops without spending it.
            raise ConfigError(
                "OSO's additive C rule scales by the learning rate, and this update rule or optimizer "
                f"has none (lr = {lr}); use rule='exp' (the default) or 'normalized'."
            )
        clip = state["clip"]
        grads = ctx.grads(params)
        norms = grads.norms
        # Both queries are weighted sums of the same per-sample gradients: clip weights and
        # q weights 1[‖g‖ > C]/‖g‖ (unit-norm rows, so sensitivity 1).
        wide = norms.to(weights_dtype(norms.dtype))
        q_w = torch.where(wide > clip, 1.0 / wide.clamp_min(1e-12), torch.zeros_like(wide))
        deferred = self.defer_q_noise and self.rule != "normalized"
        g_sum, q_out = ctx.publish(
            SumQuery("gradient", clipped_sum(grads, clip), clip, state["nu_g"]),
            SumQuery("clip_hypergradient", grads.weighted_sum(q_w), 1.0, state["nu_q"], deferred=deferred),
            label=f"{label}/gradient+q",
        )
        L = ctx.run.expected_batch_size
        released = Released(g_sum, L, clip, state["nu_g"] * clip)
        g = released.gradient()
        # A deferred q̃_t stays a handle; a gateway that returns tensors (test stubs) is also fine.
        q = q_out.scaled(1.0 / L) if isinstance(q_out, DeferredSum) else tree.scale(q_out, 1.0 / L)
        prev_q, new_clip, gq = state["prev_q"], clip, 0.0
        if prev_q is not None:
            # g̃_t is independent of q̃_{t−1}'s noise: the one projection is exact (docs/privacy.md).
            d = ctx.release.project(prev_q, g, host=False) if isinstance(prev_q, DeferredSum) else dot(g, prev_q)
            new_clip, gq = rule_step(self.rule, clip, state["clip_lr"], d, (g, prev_q), lr, MIN_CLIP)
        return released, {**state, "clip": new_clip, "prev_q": q}, {"clip": clip, "g_dot_q": gq}


@dataclass(frozen=True)
class ZerothOrderClip(Privatizer):
    """DP zeroth-order optimisation (DP-ZO; Tang, Panda, Nasr, Mahloujifar & Mittal 2024; used by Panda et al. 2024,
    §A.4, Table 14): the released quantity is ONE scalar per step, s̃_t = Σ_{i∈B_t} clip_C(d_i) + N(0, ν²C²) with d_i
    the central difference of example i's loss along a public direction z_t ~ N(0, I_d), released as (s̃_t / L)·z_t.
    Sensitivity C, hence DP-SGD's event: docs/privacy.md, "DP-ZO"."""

    clip: float = 1.0  # C, the bound on each example's finite difference
    perturbation: float = 1e-3  # μ (MeZO / DP-ZO: 1e-3)
    name = "zo"
    # Stacked trials (``vectorized.train_many``) share one batched forward per step; the two
    # perturbed evaluations per trial are not implemented there, so trials run one by one.
    stackable: ClassVar[bool] = False
    hyperparameters = ("clip", "perturbation")

    def __post_init__(self) -> None:
        check_clip("clip (C)", self.clip)
        check_positive("perturbation (μ)", self.perturbation)

    def init(self, run: RunPlan) -> dict[str, Any]:
        return {"directions": None}

    @staticmethod
    def _direction_source(ctx: StepContext) -> NoiseSource:
        """z's stream: its own, derived from the gateway's noise seed (secure mode: the OS CSPRNG),
        so that drawing z never shifts the privacy noise; of its class (distributed: rank 0's, broadcast)."""
        noise = getattr(ctx.release, "noise", None)
        if noise is None:  # a test stub without a noise source: a fixed seed (never a real run's gateway)
            return NoiseSource(stream_seed(0, "zo-directions"))
        return type(noise)(stream_seed(noise.seed, "zo-directions"), noise.device, noise.secure)

    def differences(self, params: Tensors, z: Tensors, ctx: StepContext) -> torch.Tensor:
        """The clipped per-example finite differences clip_C(d_i) (float64, [B]).

        Both passes start from the same state of torch's random streams (MeZO's seed reset): a
        model with dropout draws the same masks at θ + μz and θ − μz, so d_i is the difference
        of one function (independent masks would make it mask noise / 2μ, clipped to ±C)."""
        mu = self.perturbation
        plus, minus = tree.add_scaled(params, mu, z), tree.add_scaled(params, -mu, z)
        device = inputs.device_of(ctx.x)
        rng = rng_state(device)
        lp = ctx.oracle.losses(plus, ctx.x, ctx.y).double()
        set_rng_state(device, rng)
        d = (lp - ctx.oracle.losses(minus, ctx.x, ctx.y).double()) / (2.0 * mu)
        d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))  # one bad example adds 0, not NaN
        return d.clamp(-self.clip, self.clip)

    def privatize(self, params, state, ctx, *, lr, label):
        src = state["directions"] or self._direction_source(ctx)
        with torch.no_grad():
            z = random_direction(src, params)
            d = self.differences(params, z, ctx)
        total = torch.tensor(math.fsum(d.tolist()), dtype=torch.float64)
        (nu,) = self.multipliers(ctx.run)
        (noisy,) = ctx.publish(
            SumQuery("zo_directional_derivative", total, self.clip, nu), label=f"{label}/zo_derivative"
        )
        s, L = float(noisy), ctx.run.expected_batch_size
        return (
            Released(tree.scale(z, s), L, self.clip, nu * self.clip),
            {**state, "directions": src},
            {"clip": self.clip, "zo_derivative": s / L},
        )


@dataclass(frozen=True)
class NonPrivate(Privatizer):
    """The batch-mean gradient, unclipped and without noise: ε = ∞ (Galli's NoDP baseline)."""

    name = "none"
    private = False

    def multipliers(self, run: RunPlan) -> tuple[float, ...]:
        return (math.inf,)  # no noise: a non-private event

    def privatize(self, params, state, ctx, *, lr, label):
        assert ctx.release is not None
        record_nonprivate(ctx.release.ledger, f"{label}/gradient", run=ctx.release.run)
        if ctx.batch_size == 0:
            return None, state, {}
        _, g = ctx.oracle.loss_and_grad(params, ctx.x, ctx.y)
        return Released(g, None, None), state, {}


PRIVATIZERS: dict[str, type[Privatizer]] = {
    c.name: c for c in (FixedClip, QuantileClip, OSOClip, ZerothOrderClip, NonPrivate)
}

# fmt: off
__all__ = [
    "Released", "Privatizer", "FixedClip", "QuantileClip", "OSOClip", "ZerothOrderClip", "NonPrivate", "PRIVATIZERS",
    "clip_weights", "clipped_sum", "RULES",
]
# fmt: on
