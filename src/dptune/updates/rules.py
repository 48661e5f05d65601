"""Update rules: how released gradients move the parameters (pure post-processing: a rule sees ``Released`` values
only, never the batch). Optax-style: ``init(params, run) -> state``, ``update(params, state, released) -> (params,
state, metrics)``, ``rate(state)`` (public), optionally ``finalize`` (a free step at the end). docs/strategies.md."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

import torch

from dptune import tree
from dptune.errors import ConfigError, check_positive, check_unit_interval
from dptune.release.context import RunPlan
from dptune.release.hypergradient import Rule, check_rate, check_rule, horizon_rate, rule_step
from dptune.release.privatizers import Released
from dptune.tree import Tensors, add_scaled, dot, ema, zeros_like
from dptune.updates.defaults import default_adam_lr, default_sgd_lr


def heavy_ball(
    params: Tensors, buf: Tensors | None, g: Tensors, lr: float, momentum: float, scale: float | None = None
) -> tuple[Tensors, Tensors | None]:
    """θ ← θ − lr·m with m ← μ·m + s·g (PyTorch SGD convention, no dampening). μ = 0: plain SGD.

    ``scale=None`` (s = 1): rounded exactly as the per-tensor expressions θ − lr·g and μ·m + g. ``scale=s``: g is an
    unscaled sum (the noisy clipped sum, s = 1/L) and s is folded into fused multiply-adds: θ + (−lr·s)·g is ONE pass
    over θ and g instead of three (g·s, lr·(g·s), θ − ·), the same up to the last bits."""
    if scale is None:
        if momentum == 0.0:
            return tree.axpy(-lr, g, params), None
        buf = g if buf is None else tree.axpy(momentum, buf, g)
        return tree.axpy(-lr, buf, params), buf
    if momentum == 0.0:
        return tree.add_scaled(params, -lr * scale, g), None
    buf = tree.scale(g, scale) if buf is None else tree.ema(momentum, buf, scale, g)
    return tree.add_scaled(params, -lr, buf), buf


class UpdateRule(ABC):
    """Base class. Subclasses are frozen dataclasses of hyperparameters."""

    name: ClassVar[str]
    hyperparameters: ClassVar[tuple[str, ...]] = ()
    finalizes: ClassVar[bool] = False  # does ``finalize`` change the parameters?
    needs_noisy_release: ClassVar[bool] = False  # refuses the NonPrivate privatizer

    def validate_run(self, run: RunPlan) -> None:
        """Raise ConfigError if this rule cannot run with these run settings."""

    @abstractmethod
    def init(self, params: Tensors, run: RunPlan) -> dict[str, Any]: ...

    @abstractmethod
    def update(
        self, params: Tensors, state: dict[str, Any], released: Released
    ) -> tuple[Tensors, dict[str, Any], dict[str, float]]: ...

    def rate(self, state: dict[str, Any]) -> float:
        """The learning rate the next update applies (public: a function of released values)."""
        return float(self.lr)

    def finalize(self, params: Tensors, state: dict[str, Any]) -> Tensors:
        """Post-processing after the last step (free of privacy cost). Default: none."""
        return params

    def evaluated(self, params: Tensors, state: dict[str, Any]) -> Tensors:
        """The parameters an evaluation during training scores (and a best checkpoint keeps).
        Default: the iterate itself; ``Averaged``: the running average of the iterates."""
        return params

    def config(self) -> dict[str, Any]:
        return dict(asdict(self))  # type: ignore[call-overload]


class _StateRate(UpdateRule):
    """A built-in rule's ``rate``: the lr its state holds (NaN while None: set by the first release)."""

    def rate(self, state: dict[str, Any]) -> float:
        return state["lr"] if state["lr"] is not None else math.nan


@dataclass(frozen=True)
class SGD(_StateRate):
    """m_t = μ·m_{t−1} + g̃_t;  θ_{t+1} = θ_t − lr·m_t; ``final_step``: θ ← θ − lr·m_T after training
    (Panda §A.3). ``lr=None``: the linear-scaling default lr_t = r·(1 − μ)/(C_t·T) (``SGD_STEP_BUDGET``, grown
    at low noise), so the effective step r/T stays fixed when an adaptive privatizer moves C_t."""

    lr: float | None = 0.1
    momentum: float = 0.0
    final_step: bool = False
    name = "sgd"
    hyperparameters = ("lr", "momentum", "final_step")

    def __post_init__(self) -> None:
        if self.lr is not None:
            check_positive("lr", self.lr)
        check_unit_interval("momentum", self.momentum)

    @property
    def finalizes(self) -> bool:  # type: ignore[override]
        return bool(self.final_step)

    def init(self, params, run):
        return {"momentum": None, "lr": self.lr, "run": run}

    def update(self, params, state, released):
        lr = self.lr if self.lr is not None else default_sgd_lr(state["run"], released.clip, self.momentum)
        # g̃ = total / L, folded into the update (fused multiply-adds, see heavy_ball).
        params, buf = heavy_ball(params, state["momentum"], released.total, lr, self.momentum,
                                 scale=released.scale)  # fmt: skip
        return params, {**state, "momentum": buf, "lr": lr}, {"lr": lr}

    def finalize(self, params, state):
        if self.final_step and state.get("momentum") is not None:
            return {k: params[k] - state["lr"] * state["momentum"][k] for k in params}
        return params


@dataclass(frozen=True)
class Adam(_StateRate):
    """m_t = β₁ m_{t−1} + (1−β₁) g̃_t,  v_t = β₂ v_{t−1} + (1−β₂) g̃_t²
    θ_{t+1} = θ_t − lr · m̂_t / (√v̂_t + ε),  m̂_t = m_t/(1−β₁ᵗ), v̂_t = v_t/(1−β₂ᵗ).
    ``lr=None``: the linear-scaling default lr = r/T, r = ``ADAM_STEP_BUDGET`` (≤ ``PRETRAINED_ADAM_LR`` fine-tuning)."""

    lr: float | None = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    name = "adam"
    hyperparameters = ("lr", "beta1", "beta2", "eps")

    def __post_init__(self) -> None:
        if self.lr is not None:
            check_positive("lr", self.lr)
        check_unit_interval("beta1", self.beta1)
        check_unit_interval("beta2", self.beta2)
        check_positive("eps", self.eps)

    def init(self, params, run):
        lr = self.lr if self.lr is not None else default_adam_lr(run)
        return {"m": zeros_like(params), "v": zeros_like(params), "t": 0, "lr": lr}

    def update(self, params, state, released):
        t = state["t"] + 1
        b1, b2, eps, lr = self.beta1, self.beta2, self.eps, state["lr"]
        c1, c2 = 1 - b1**t, 1 - b2**t

        def adam(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
            m = m * b1 + g * (1 - b1)
            v = v * b2 + (g * (1 - b2)) * g  # v ← β₂ v + ((1−β₂)·g)·g, rounded in that order
            # θ − lr·(m/c1) / (sqrt(v/c2) + ε); −lr folds the subtraction into an addition exactly
            # (negation commutes with every rounding here).
            return p + (m / c1).mul_(-lr).div_((v / c2).sqrt_().add_(eps)), m, v

        # One kernel per operation over all parameters (``tree.flat_map``).
        params, m, v = tree.flat_map(adam, params, state["m"], state["v"], released.gradient())
        return params, {**state, "m": m, "v": v, "t": t}, {"lr": lr}


@dataclass(frozen=True)
class AdamWOSM(_StateRate):
    """Adam's bias-corrected first moment at the effective step size lr = α / (ν_g·C/L + 10⁻⁸)
    (Mohapatra et al. 2022, Algorithm 2), σ of the first step's release: fixed for the run."""

    alpha: float | None = 1e-3  # None: the linear-scaling default α = r/T, r = ADAM_STEP_BUDGET
    beta1: float = 0.9
    name = "adamwosm"
    hyperparameters = ("alpha", "beta1")
    needs_noisy_release: ClassVar[bool] = True  # the ESS is defined by the noise: no NonPrivate

    def __post_init__(self) -> None:
        if self.alpha is not None:
            check_positive("alpha", self.alpha)
        check_unit_interval("beta1", self.beta1)

    def init(self, params, run):
        alpha = self.alpha if self.alpha is not None else default_adam_lr(run)
        return {"m": zeros_like(params), "t": 0, "lr": None, "alpha": alpha}

    def update(self, params, state, released):
        if released.divisor is None or released.noise_std is None:
            raise ConfigError("adamwosm's step size needs a clipped, noisy gradient; use 'adam' without privacy.")
        lr = state["lr"]
        if lr is None:  # the effective step size, fixed by the first release's σ
            lr = state["alpha"] / (released.noise_std / released.divisor + 1e-8)
        t = state["t"] + 1
        # m ← β₁m + (1−β₁)·total/L and θ ← θ − (lr/c1)·m: 1/L and 1/c1 folded into fused
        # multiply-adds (two passes for m, one for θ; the same up to the last bits).
        m = ema(self.beta1, state["m"], (1 - self.beta1) / released.divisor, released.total)
        c1 = 1 - self.beta1**t
        params = add_scaled(params, -lr / c1, m)
        return params, {**state, "m": m, "t": t, "lr": lr}, {"lr": lr}


MIN_RATE = 1e-12  # ρ stays a valid (positive) learning rate under the additive rule


@dataclass(frozen=True)
class OSORate(_StateRate):
    """Heavy ball with ρ learned online (Galli et al. 2024, Alg. 1 line 15): ρ_{t+1} = ρ_t · exp(ρ_r ·
    sign(g̃_tᵀ m_{t−1})); ``additive``/``normalized`` variants; ``adapt_lr=False``: ρ stays ρ₀."""

    lr: float | None = None  # ρ₀; None → linear scaling, 200·(1 − μ)/(C₀·T) (C₀: the first release's C)
    lr_lr: float | None = None  # ρ_r; None → OSO_LOG_RANGE / T (horizon-aware)
    rule: Rule = "exp"
    momentum: float = 0.0
    adapt_lr: bool = True
    name = "oso_rate"
    hyperparameters = ("lr", "lr_lr", "rule", "momentum", "adapt_lr")

    def __post_init__(self) -> None:
        if self.lr is not None:
            check_positive("lr (ρ₀)", self.lr)
        check_rate("lr_lr (ρ_r)", self.lr_lr)
        check_rule(self.rule)
        check_unit_interval("momentum", self.momentum)

    def init(self, params, run):
        return {"lr": self.lr, "prev_g": None, "momentum": None, "lr_lr": horizon_rate(self.lr_lr, run), "run": run}

    def update(self, params, state, released):
        # ρ₀ by linear scaling, from the first release's C₀
        lr = state["lr"] if state["lr"] is not None else default_sgd_lr(state["run"], released.clip, self.momentum)
        g = released.gradient()
        params, buf = heavy_ball(params, state["momentum"], g, lr, self.momentum)
        prev_g, new_lr, gg = state["prev_g"], lr, 0.0
        if self.adapt_lr and prev_g is not None:
            new_lr, gg = rule_step(self.rule, lr, state["lr_lr"], dot(g, prev_g), (g, prev_g), lr, MIN_RATE)
        # With momentum, ∂θ_t/∂ρ_{t-1} = −m_{t−1}: keep the applied direction for the next ρ rule.
        direction = buf if buf is not None else g
        return (params, {**state, "lr": new_lr, "prev_g": direction, "momentum": buf}, {"lr": lr, "g_dot_g": gg})


def extrapolation_error(full: Tensors, halves: Tensors) -> float:
    """err = ‖(θ₁ − θ₂) / max(1, |θ₁|)‖₂, elementwise division (Koskela & Honkela's mixed
    absolute/relative error: absolute for |θ₁| ≤ 1, relative above)."""
    sq = [(((a.double() - halves[k].double()) / a.double().abs().clamp_min(1.0)) ** 2).sum() for k, a in full.items()]
    return math.sqrt(float(torch.stack(sq).sum()))  # one host read, not one per tensor


@dataclass(frozen=True)
class ADADP(_StateRate):
    """Step size η adapted by one full step against two half steps (Koskela & Honkela, AISTATS 2020), each
    gradient a fresh release; τ defaults to sqrt(d / (2T)). Equations and choices: docs/strategies.md."""

    lr: float = 1e-3  # η₀
    tolerance: float | None = None  # τ; None → sqrt(d / (2T))
    min_factor: float = 0.9  # α_min
    max_factor: float = 1.1  # α_max
    safety: float = 1.0  # s
    reject: bool = True
    name = "adadp"
    hyperparameters = ("lr", "tolerance", "min_factor", "max_factor", "safety", "reject")

    def __post_init__(self) -> None:
        check_positive("lr (η₀)", self.lr)
        if self.tolerance is not None:
            check_positive("tolerance (τ)", self.tolerance)
        check_positive("min_factor (α_min)", self.min_factor)
        check_positive("max_factor (α_max)", self.max_factor)
        check_positive("safety", self.safety)
        if not self.min_factor <= 1.0 <= self.max_factor:
            raise ConfigError(
                f"ADADP needs min_factor ≤ 1 ≤ max_factor, got {self.min_factor} and {self.max_factor}; "
                "the defaults are 0.9 and 1.1."
            )

    def tau(self, run: RunPlan, num_params: int) -> float:
        """τ: the given tolerance, or sqrt(d / (2T)) with d = ``num_params`` (Mohapatra et al. A.1)."""
        if self.tolerance is not None:
            return float(self.tolerance)
        return math.sqrt(num_params / (2.0 * run.steps))

    def lr_factor(self, err: float, tau: float) -> float:
        """min(max(s·sqrt(τ/err), α_min), α_max); err = 0 → α_max."""
        if err <= 0.0:
            return self.max_factor
        if not math.isfinite(err):
            return self.min_factor
        return min(max(self.safety * math.sqrt(tau / err), self.min_factor), self.max_factor)

    def init(self, params, run):
        tau = self.tau(run, sum(v.numel() for v in params.values()))
        return {"lr": float(self.lr), "tau": tau, "theta0": None, "theta_full": None, "accepted": 0, "rejected": 0}

    def update(self, params, state, released):
        lr = state["lr"]
        g = released.gradient()
        if state["theta0"] is None:
            # First half of a cycle: remember θ₀ and the full-step point θ₁, move to θ_½.
            with torch.no_grad():
                full = {k: params[k] - lr * g[k] for k in params}
                half = {k: params[k] - (0.5 * lr) * g[k] for k in params}
            return half, {**state, "theta0": params, "theta_full": full}, {"lr": lr}
        # Second half: finish the two half steps, estimate the error, adapt η, accept/reject.
        with torch.no_grad():
            two_halves = {k: params[k] - (0.5 * lr) * g[k] for k in params}
        err = extrapolation_error(state["theta_full"], two_halves)
        tau = state["tau"]
        accept = err <= tau or not self.reject
        out = two_halves if accept else state["theta0"]
        counts = {"accepted": state["accepted"] + int(accept), "rejected": state["rejected"] + int(not accept)}
        state = {**state, "lr": lr * self.lr_factor(err, tau), "theta0": None, "theta_full": None, **counts}
        return out, state, {"lr": lr, "adadp_error": err, "accepted": float(accept)}


Average = Literal["none", "ema", "swa"]
AVERAGES = ("none", "ema", "swa")
EMA_WINDOW_FRACTION = 0.1  # ema_decay=None: an effective window of T/10 steps, β = 1 − 1/(T/10)


def check_average(average: str, ema_decay: float | None, swa_start: float) -> None:
    """The averaging options of ``Averaged`` (and of the strategies that expose them)."""
    if average not in AVERAGES:
        raise ConfigError(f"average must be one of {', '.join(AVERAGES)}, got {average!r}. Fix: e.g. average='ema'.")
    if ema_decay is not None:
        check_unit_interval("ema_decay", ema_decay)
    check_unit_interval("swa_start", swa_start)


def default_ema_decay(run: RunPlan) -> float:
    """β = 1 − 1/(T/10), at least 0: the EMA's effective window (1/(1 − β)) is the last tenth of
    the run (a function of the planned T: public)."""
    return max(0.0, 1.0 - 1.0 / (EMA_WINDOW_FRACTION * max(run.steps, 1)))


def swa_first_step(swa_start: float, steps: int) -> int:
    """The first iterate SWA averages: ⌊swa_start·T⌋ + 1, within [1, T]."""
    return min(max(int(math.floor(swa_start * steps)) + 1, 1), max(steps, 1))


@dataclass(frozen=True)
class Averaged(UpdateRule):
    """Any update rule, with the EMA or SWA *of its iterates* as the parameters a run evaluates and returns
    (Panda et al. 2024 §A.5); the iterates keep following the rule. No privacy spent: post-processing of the
    run's releases, with weights a function of the planned T (docs/strategies.md)."""

    rule: UpdateRule
    average: Average = "ema"
    ema_decay: float | None = None  # β; None → 1 − 10/T (``default_ema_decay``)
    swa_start: float = 0.5  # fraction of T before SWA starts averaging
    name = "averaged"

    def __post_init__(self) -> None:
        if not isinstance(self.rule, UpdateRule):
            raise ConfigError(f"Averaged wraps an update rule (dptune.updates), got {self.rule!r}.")
        check_average(self.average, self.ema_decay, self.swa_start)

    @property
    def needs_noisy_release(self) -> bool:  # type: ignore[override]
        return bool(self.rule.needs_noisy_release)

    @property
    def finalizes(self) -> bool:  # type: ignore[override]
        return self.average != "none" or bool(self.rule.finalizes)

    def validate_run(self, run: RunPlan) -> None:
        self.rule.validate_run(run)

    def init(self, params, run):
        decay = self.ema_decay if self.ema_decay is not None else default_ema_decay(run)
        inner, first = self.rule.init(params, run), swa_first_step(self.swa_start, run.steps)
        # avg: θ̄ (None: nothing averaged yet); count: the iterates averaged so far; t: those seen so far
        return {"inner": inner, "avg": None, "count": 0, "t": 0, "decay": float(decay), "first": first}

    def rate(self, state):
        return self.rule.rate(state["inner"])

    def _fold(self, state: dict[str, Any], params: Tensors) -> dict[str, Any]:
        """θ̄ with the iterate ``params`` (iterate number state["t"] + 1) folded in."""
        t, avg, count = state["t"] + 1, state["avg"], state["count"]
        if self.average == "ema":
            beta = state["decay"]
            w = 1.0 if avg is None else (1.0 - beta) / (1.0 - beta**t)
        elif self.average == "swa" and t >= state["first"]:
            w = 1.0 / (count + 1)
        else:  # "none", or SWA before its first iterate
            return {**state, "t": t}
        with torch.no_grad():
            avg = tree.clone(params) if avg is None else tree.add_scaled(avg, w, tree.axpy(-1.0, avg, params))
        return {**state, "t": t, "avg": avg, "count": count + 1}

    def update(self, params, state, released):
        params, inner, info = self.rule.update(params, state["inner"], released)
        return params, self._fold({**state, "inner": inner}, params), info

    def evaluated(self, params, state):
        return state["avg"] if state["avg"] is not None else self.rule.evaluated(params, state["inner"])

    def finalize(self, params, state):
        final = self.rule.finalize(params, state["inner"])
        if self.average == "none":
            return final
        if self.rule.finalizes:  # the free step's θ_{T+1} is one more iterate
            state = self._fold(state, final)
        return state["avg"] if state["avg"] is not None else final  # None: stopped before SWA began


UPDATES: dict[str, type[UpdateRule]] = {c.name: c for c in (SGD, Adam, AdamWOSM, OSORate, ADADP)}
