"""The named strategies, each a recipe over ``chain(privatizer, update)`` as in optax
(``adam = chain(scale_by_adam(...), scale(-lr))``), not a class that repeats its parts.

A recipe names its parts (template instances, whose values are its defaults), its public name,
what it hides or re-orders, and its docstring (paper and equations). Its hyperparameters (names,
defaults, types for ``check_types``, order) are the parts' fields; only what is really special
(DP-GD's full batch, ``zero_init`` and averaging) is code. Adding a strategy touches ONE entry:
a ``@recipe`` class here (``make_strategy``, the CLI and studies then know it by name; list it in
``strategies/__init__`` to export the class too)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import torch

from dptune.errors import ConfigError
from dptune.release.context import RunPlan
from dptune.release.privatizers import FixedClip, NonPrivate, OSOClip, Privatizer, QuantileClip, ZerothOrderClip
from dptune.strategies.base import Composed
from dptune.tree import Tensors
from dptune.updates import ADADP as ADADPRule
from dptune.updates import SGD, Adam, Averaged, OSORate, UpdateRule, check_average
from dptune.updates import AdamWOSM as AdamWOSMRule

STRATEGIES: dict[str, type[Recipe]] = {}


class Recipe(Composed):
    """A named strategy: its fields are its hyperparameters, given flat to the parts that take them."""

    templates: ClassVar[tuple[Privatizer, UpdateRule]]
    averaged: ClassVar[bool] = False  # the averaging options of ``updates.Averaged`` (off: "none")

    def parts(self) -> tuple[Privatizer, UpdateRule]:
        hp = {k: getattr(self, k) for k in self.hyperparameters}
        if self.averaged:  # checked even when off, so a bad value is never silently kept
            check_average(hp["average"], hp["ema_decay"], hp["swa_start"])
        p, u = self.templates  # each part gets the hyperparameters it takes; a hidden one keeps its value
        privatizer = type(p)(**{k: hp.get(k, v) for k, v in p.config().items()})
        update = type(u)(**{k: hp.get(k, v) for k, v in u.config().items()})
        if self.averaged and hp["average"] != "none":
            update = Averaged(update, hp["average"], hp["ema_decay"], hp["swa_start"])
        return privatizer, update


def recipe(
    name: str,
    privatizer: Privatizer,
    update: UpdateRule,
    *,
    hide: tuple[str, ...] = (),
    order: tuple[str, ...] | None = None,
    average: bool = False,
) -> Callable[[type[Recipe]], type[Recipe]]:
    """Make the decorated class the named strategy ``chain(privatizer, update)``.

    Its hyperparameters are the parts' fields (less ``hide``, which keep the template's value;
    plus ``Averaged``'s with ``average``, and the class's own), with the templates' values as
    defaults; a default re-set to a value takes that type only (nodp's ``lr``: no ``None``).
    Order: ``lr`` first, then the privatizer's, the update rule's, the class's own; or ``order``."""

    def make(cls: type[Recipe]) -> type[Recipe]:
        found: dict[str, tuple[str, Any]] = {}  # hyperparameter → (type, default)
        for part in (privatizer, update, *([Averaged(update, "none")] if average else [])):
            for f in fields(part):  # type: ignore[arg-type]
                if f.name in hide or f.default is MISSING:  # Averaged's rule: the wrapped rule
                    continue
                kind, value = str(f.type), getattr(part, f.name)
                if value is not None and value != f.default:
                    kind = " | ".join(t.strip() for t in kind.split("|") if t.strip() != "None")
                found.setdefault(f.name, (kind, value))
        found.update({k: (str(t), getattr(cls, k)) for k, t in inspect.get_annotations(cls).items()})
        names = order or tuple(sorted(found, key=lambda k: k != "lr"))
        assert sorted(names) == sorted(found), f"{name}: order {names} is not a permutation of {sorted(found)}"
        cls.__annotations__ = {k: found[k][0] for k in names}
        for k in names:
            setattr(cls, k, found[k][1])
        cls.name, cls.private, cls.hyperparameters = name, privatizer.private, names
        cls.templates, cls.averaged = (privatizer, update), average
        STRATEGIES[name] = dataclass(frozen=True)(cls)
        return cls

    return make


@recipe("nodp", NonPrivate(), SGD(lr=0.3), hide=("final_step",))
class NoDP(Recipe):
    """Galli's NoDP baseline = chain(NonPrivate(), SGD(lr, μ)): (momentum) SGD on the Poisson
    batch's mean loss, each step a ``NonPrivateDpEvent`` (ε = ∞). lr = 0.3 (measured)."""


@recipe("dpsgd", FixedClip(), SGD(lr=None, momentum=0.9), hide=("final_step",))
class DPSGD(Recipe):
    """FixedThreshold DP-SGD (Abadi et al. 2016; μ > 0: DP-Momentum, Mohapatra et al. 2022 A.1) =
    chain(FixedClip(C), SGD(lr, μ)), one Gaussian release of multiplier ν per step:
      g̃_t = (Σ_{i∈B_t} clip_C(g_i) + N(0, ν²C²I)) / L;   m_t = μ·m_{t−1} + g̃_t;   θ_{t+1} = θ_t − lr·m_t
    (Galli eqs. 4, 18; L = expected batch). Defaults C = 1, μ = 0.9, lr by Panda et al.'s linear
    scaling r·(1 − μ)/(C·T), r = 200 grown at low noise (docs/strategies.md, "Defaults")."""


@recipe("quantile", QuantileClip(), SGD(lr=None, momentum=0.9), hide=("final_step",))
class FixedQuantile(Recipe):
    """FixedQuantile (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021) = chain(QuantileClip(γ, η_C,
    C₀, σ_b), SGD(lr, μ)): C_{t+1} = C_t · exp(−η_C (b̃_t − γ)), b̃_t a noisy unclipped fraction
    released with g̃_t as ONE Gaussian of multiplier ν (equations: ``QuantileClip``). Defaults
    γ = 0.5, η_C = 0.2, σ_b = L/20 (Andrew et al.), C₀ = 1, μ = 0.9, lr_t = 200·(1 − μ)/(C_t·T)."""


_OSO_ORDER = ("lr", "initial_clip", "clip_lr", "lr_lr", "q_noise_multiplier", "relative_increase", "rule")


@recipe("oso", OSOClip(), OSORate(), order=(*_OSO_ORDER, "momentum", "adapt_lr"))
class OSO(Recipe):
    """OSO-DPSGD (Galli, Palamidessi, Cucinotta, AAAI 2024, Algorithm 1, typos corrected) =
    chain(OSOClip(C₀, ρ_c, ν_q, rule), OSORate(ρ₀, ρ_r, rule, μ)). Per step t:
      g̃_t = (Σ clip_{C_t}(g_i) + N(0, ν_g² C_t² I)) / L                            (eq. 18, line 11)
      q̃_t = (Σ 1[‖g_i‖ > C_t] g_i/‖g_i‖ + N(0, ν_q² I)) / L    (eqs. 11, 17; line 13 writes ν_g: typo)
      θ_{t+1} = θ_t − ρ_t g̃_t                                  (line 12 writes ĝ_t: it is g̃_t)
      C_{t+1} = C_t · exp(ρ_c · sign(g̃_tᵀ q̃_{t−1}))                                (eq. 20)
      ρ_{t+1} = ρ_t · exp(ρ_r · sign(g̃_tᵀ g̃_{t−1}))            (line 15; eq. 21 writes q̃: typo)
    with q̃_0 = g̃_0 = 0 and ν_g = (ν⁻² − ν_q⁻²)^(−½) (Proposition 1: one Gaussian of multiplier
    ν), ν_q by the 1% rule (ν_g = 1.01ν). ``rule`` (both parts): ``additive`` (eqs. 13, 16) or
    ``normalized`` (eq. 19); with momentum the ρ rule uses g̃_tᵀm_{t−1} (``OSOClip``, ``OSORate``)."""


@recipe("dpadam", FixedClip(), Adam(lr=None))
class DPAdam(Recipe):
    """DP-Adam (Mohapatra et al. 2022, A.1) = chain(FixedClip(C), Adam(lr, β₁, β₂, ε)), i.e.
    ``"fixed+adam"`` with lr = None: Adam (Kingma & Ba) on DP-SGD's g̃_t, post-processing of one
    Gaussian release per step. Default lr = 0.8/T (linear scaling for Adam)."""


@recipe("adamwosm", FixedClip(), AdamWOSMRule(alpha=None))
class AdamWOSM(Recipe):
    """DPAdamWOSM, DP-Adam without second moment (Mohapatra et al. 2022, Algorithm 2) =
    chain(FixedClip(C), updates.AdamWOSM(α, β₁)): the bias-corrected first moment at the effective
    step size α/(νC/L + 10⁻⁸), L the expected batch (not the private |L_t|). Default α = 0.8/T."""


_DPGD_ORDER = ("lr", "clip", "momentum", "zero_init", "final_step", "average", "ema_decay", "swa_start")


@recipe("dpgd", FixedClip(), SGD(lr=None, momentum=0.9, final_step=True), average=True, order=_DPGD_ORDER)
class DPGD(Recipe):
    """Full-batch DP-GD with momentum (Panda et al. 2024, Algorithm 1) = chain(FixedClip(C), SGD(η,
    μ, final_step)) at q = 1 (each step a plain Gaussian); with Panda's unit clipping C = 1:
      ∇_t = (Σ_{i∈D} clip_1(g_i) + N(0, ν²I)) / n;   v_t = μ v_{t−1} + ∇_t;   w_t = w_{t−1} − η v_t
    divided by n, unlike Panda, so that η is comparable across strategies (η = n·η_Panda).
    ``zero_init``: parameters 0 before training (Table 1); ``final_step``: one free step
    w ← w − η v_T after it (§A.3); ``average`` (§A.5): the run evaluates and returns the EMA or
    SWA of the iterates (``updates.Averaged``, post-processing). Default η = 200·(1 − μ)/(C·T)."""

    zero_init: bool = False

    def validate_run(self, run: RunPlan) -> None:
        if run.sampling_rate < 1.0:
            raise ConfigError(
                f"dpgd is full-batch DP-GD: it needs q = 1, got q = {run.sampling_rate:.4g}. "
                "Set full_batch=True (or expected_batch_size = n), or use 'dpsgd' with momentum."
            )

    def init(self, params: Tensors, run: RunPlan):
        self.validate_run(run)
        return super().init(params, run)

    def prepare(self, params: Tensors) -> Tensors:
        return {k: torch.zeros_like(v) for k, v in params.items()} if self.zero_init else params


@recipe("dpzo", ZerothOrderClip(), SGD(lr=None), hide=("final_step",))
class DPZO(Recipe):
    """DP-ZO (Tang, Panda, Nasr, Mahloujifar & Mittal 2024; Panda et al. 2024 §A.4) =
    chain(ZerothOrderClip(C, μ), SGD(η, momentum)): a step along z_t ~ N(0, I_d) scaled by the
    privatized s̃_t = Σ clip_C(d_i) + N(0, ν²C²), d_i = (ℓ(θ + μz_t; x_i) − ℓ(θ − μz_t; x_i))/(2μ),
    since E[(∇ℓ·z)z] = ∇ℓ: one scalar release of sensitivity C per step, DP-SGD's event (privacy:
    ``ZerothOrderClip``). Defaults C = 1, μ = 10⁻³ (after MeZO), η = 200/(C·T) (Panda Table 14)."""


@recipe("adadp", FixedClip(), ADADPRule(lr=0.5))
class ADADP(Recipe):
    """ADADP (Koskela & Honkela, "Learning Rate Adaptation for Differentially Private Learning",
    AISTATS 2020, arXiv:1809.03832; Mohapatra et al. 2022 A.1) = chain(FixedClip(C),
    updates.ADADP(η₀, τ, α_min, α_max, s)): every other step, one full step against two half steps,
    err = ‖(θ₁ − θ₂)/max(1, |θ₁|)‖₂, η ← η·min(max(s·sqrt(τ/err), α_min), α_max), the pair undone
    if err > τ (equations: ``updates.ADADP``). Where the sources are loose, the authors' code
    (DPBayes/ADADP, d3p): each gradient is a fresh Poisson batch and one step (one release of
    multiplier ν: ``releases_per_run(T) = T``); rejection on; err = 0 gives α_max; with T odd the
    last half step is kept. Defaults α_min = 0.9, α_max = 1.1, s = 1, τ = sqrt(d/(2T)) (Mohapatra
    A.1), η₀ = 0.5 (measured: the authors' 1e-3 grows ×1.1 per cycle, too slow for short runs)."""
