"""``run_audit``: an empirical ε lower bound for one of dptune's strategies at a claimed (ε, δ), from
the REAL strategy calibrated to the claim: one run (Steinke et al. 2023) or two worlds (Jagielski et al.
2020, white-box only). docs/reliability.md, "Privacy audits"."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from dptune import accounting
from dptune.audit import bounds
from dptune.audit.harness import (
    CANARY_NORM_FACTOR,
    CanaryData,
    LinearLossUnderMSE,
    ReleaseRecorder,
    audit_model,
    linear_loss,
    loss_scores,
    make_data,
    spy_on_releases,
)
from dptune.distributed import refuse_in_study
from dptune.errors import ConfigError
from dptune.release.ledger import Ledger
from dptune.release.sampling import stream_seed
from dptune.train import SamplingWarning, train
from dptune.tune import BudgetSpec, MethodSpec, StrategyArm, Study, TrainingSpec, run_study
from dptune.tune.data import forget_cached
from dptune.tune.spec import ModelSpec, SelectionSpec
from dptune.tune.store import Store

Method = Literal["one-run", "two-world"]
ThreatModel = Literal["white-box", "black-box"]
METHODS = ("one-run", "two-world")
THREAT_MODELS = ("white-box", "black-box")

THREAT_TEXT = {
    "white-box": (
        "white-box: the auditor crafts canary gradients (Dirac canaries, norm ≫ C, so each saturates "
        "every query's sensitivity) and observes every noisy sum released by NoisyRelease.release"
    ),
    "black-box": "black-box: the auditor sees only the final model and scores a canary by minus its loss",
}


@dataclass(frozen=True)
class Scenario:
    """What is trained in an audit: one strategy (or a grid of its settings), q, T."""

    strategy: str
    hyperparameters: dict[str, Any]
    sampling_rate: float  # q (1 = full batch)
    steps: int  # T per run
    grid: tuple[dict[str, Any], ...] = ()  # several runs composed (the 'grid' audit)
    note: str = ""

    @property
    def runs(self) -> int:
        return max(1, len(self.grid))

    def max_clip(self) -> float:
        """A clip every run stays below (canaries exceed it); over ``MAX_CANARY_NORM`` refused (review: float32 blind)."""
        vals = [1.0]
        for hp in (self.hyperparameters, *self.grid):
            vals += [float(v) for k, v in hp.items() if k in ("clip", "initial_clip")]
        # Adaptive rules move C by at most a factor e^{0.25} per step at the audited settings; fixed clips stay.
        log_margin = 0.25 * self.steps if self.strategy in ADAPTIVE_CLIP else 0.0
        if math.log(CANARY_NORM_FACTOR * max(vals)) + log_margin > math.log(MAX_CANARY_NORM):
            raise ConfigError(
                f"the canaries of this audit would need a norm above {MAX_CANARY_NORM:.0e} (clip {max(vals):g}"
                f"{f', {self.steps} steps of an adaptive clip' if log_margin else ''}), where float32 loses them. "
                "Fix: fewer steps or a smaller clip."
            )
        return max(vals) * math.exp(log_margin)


# OSO is audited with relative_increase = 3 (ν_g = 4ν): the q-query then carries 15/16 of each step's signal, so an
# error in its noise or its accounting is visible. At the paper's default (1%) the q-query carries 2% of the signal and
# an accounting error on it changes ε by ~1%, below any audit's resolution.
SCENARIOS: dict[str, Scenario] = {
    "dpsgd": Scenario("dpsgd", {"lr": 0.1, "clip": 1.0, "momentum": 0.5}, 0.5, 4),
    "quantile": Scenario("quantile", {"lr": 0.1, "momentum": 0.9, "initial_clip": 0.5, "target_quantile": 0.5}, 0.5, 4),
    "oso": Scenario(
        "oso",
        {"lr": 0.1, "initial_clip": 0.5, "relative_increase": 3.0, "clip_lr": 0.05, "lr_lr": 0.05},
        0.5,
        4,
        note="OSO at relative_increase=3 (ν_g = 4ν, ν_q ≈ 1.03ν) so that the q-query matters",
    ),
    "adamwosm": Scenario("adamwosm", {"clip": 1.0}, 0.5, 4),
    "adadp": Scenario("adadp", {"lr": 0.1, "clip": 1.0}, 0.5, 4),
    "dpgd": Scenario("dpgd", {"lr": 0.1, "clip": 1.0, "momentum": 0.9}, 1.0, 4),
    "grid": Scenario(
        "dpsgd",
        {},
        0.5,
        4,
        grid=tuple({"lr": lr, "clip": c} for lr in (0.05, 0.2) for c in (0.5, 1.0)),
        note="a whole 2×2 grid study of dpsgd (lr × clip) through dptune.tune.run_study; its budget is the claim",
    ),
}
AUDITABLE = tuple(SCENARIOS)

DEFAULT_CANARIES = {"one-run": 5000, "two-world": 20000}  # m, or trials per world
# One run: the data has one coordinate per canary, so memory grows as m² (20,000: ≈ 2 GB with the
# per-example gradients); two worlds train in chunks, so time grows with the trials (200,000: 100 trainings).
MAX_CANARIES = {"one-run": 20_000, "two-world": 200_000}
MAX_AUDITED_EPS = 20.0
TWO_WORLD_CHUNK = 2000  # trials per world per training (bounds memory: rows × coordinates)
BACKGROUND_DIM = 16  # coordinates of the background examples' gradients
ADAPTIVE_CLIP = ("quantile", "oso")  # strategies whose clipping threshold moves during the run
MAX_CANARY_NORM = 1e15  # M² = 10³⁰ and its sums stay far inside float32's range (3.4·10³⁸)


@dataclass(frozen=True)
class AuditResult:
    """An empirical ε lower bound, valid with probability ≥ ``confidence``."""

    lower_bound: float
    claimed_eps: float
    confidence: float
    method: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def flagged(self) -> bool:
        """True when the audit refutes the claim: the lower bound exceeds the claimed ε."""
        return self.lower_bound > self.claimed_eps

    def summary(self) -> str:
        d = self.details
        verdict = "VIOLATION: the claim is refuted" if self.flagged else "consistent with the claim"
        return (
            f"{d.get('strategy', '?')}: ε ≥ {self.lower_bound:.3f} with {100 * self.confidence:.6g}% confidence "
            f"({self.method}, {d.get('threat_model', '?')}); claimed ε = {self.claimed_eps:g} at "
            f"δ = {d.get('delta', float('nan')):g}: {verdict}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "lower_bound": self.lower_bound,
            "claimed_eps": self.claimed_eps,
            "confidence": self.confidence,
            "method": self.method,
            "flagged": self.flagged,
            "details": self.details,
        }


def _check_args(
    strategy: str, eps: float, delta: float, method: str, confidence: float, threat_model: str, canaries: int | None
) -> tuple[Scenario, int]:
    if not isinstance(strategy, str) or strategy.lower() not in SCENARIOS:
        raise ConfigError(f"cannot audit strategy {strategy!r}. Fix: choose one of: {', '.join(AUDITABLE)}.")
    accounting.check_epsilon(eps, "eps")
    if eps > MAX_AUDITED_EPS:  # ε = 1e308 calibrated ν for minutes, towards a grid of gigabytes
        raise ConfigError(
            f"eps = {eps:g} cannot be audited: an audit's lower bound stays below about 8 (the ceiling of its "
            f"canaries at 95% confidence), so it could never refute a claim above {MAX_AUDITED_EPS:g}. "
            "Fix: audit a claim of at most that, e.g. --eps 4."
        )
    accounting.check_delta(delta)
    if method not in METHODS:
        raise ConfigError(f"unknown audit method {method!r}. Fix: choose 'one-run' or 'two-world'.")
    bounds.check_confidence(confidence)
    if threat_model not in THREAT_MODELS:
        raise ConfigError(f"unknown threat model {threat_model!r}. Fix: choose 'white-box' or 'black-box'.")
    if method == "two-world" and threat_model == "black-box":
        raise ConfigError(
            "the vectorised two-world audit is exact only for the white-box score. Fix: use "
            "method='one-run' for the black-box (loss) score."
        )
    n = DEFAULT_CANARIES[method] if canaries is None else canaries
    if not isinstance(n, int) or isinstance(n, bool) or n < 20:
        raise ConfigError(
            f"canaries must be an integer ≥ 20, got {canaries!r} (more canaries, more power). "
            f"Fix: leave it out (default {DEFAULT_CANARIES[method]:,})."
        )
    if n > MAX_CANARIES[method]:  # 10¹² once asked numpy for 7 TiB: a traceback
        raise ConfigError(
            f"canaries = {n:,} is more than {MAX_CANARIES[method]:,}, the most a {method} audit takes "
            f"({'memory grows with the square of m' if method == 'one-run' else 'time grows with the trials'}). "
            f"Fix: use at most {MAX_CANARIES[method]:,} (default {DEFAULT_CANARIES[method]:,})."
        )
    return SCENARIOS[strategy.lower()], n


@dataclass(frozen=True)
class _Training:
    """One audit training: black-box scores (per run), its ledger, the clips it used, its ν."""

    losses: list[np.ndarray]
    ledger: Ledger
    clips: list[float]
    nu: float


def _batch(q: float, n: int) -> dict[str, Any]:
    return dict(full_batch=True) if q >= 1.0 else dict(expected_batch_size=q * n)


@dataclass(frozen=True)
class _Audit:
    """What every training of one audit shares: the scenario, the claim, the canaries' setting."""

    scenario: Scenario
    eps: float
    delta: float
    accountant: str
    seed: int
    confidence: float
    background: int
    say: Callable[[str], None]
    canary_norm: float  # M, far above every clip the scenario may use

    def data(self, present: np.ndarray, stream: str) -> CanaryData:
        return make_data(present, self.background, BACKGROUND_DIM, self.canary_norm, stream_seed(self.seed, stream))

    def train(self, data: CanaryData, seed: int, recorder: ReleaseRecorder, white_box: bool = True) -> _Training:
        """Train every run of the scenario on ``data``: a grid as one study when ``white_box``;
        black-box needs every run's final weights, so run by run, calibrated jointly (calibrate(runs=K))."""
        scenario = self.scenario
        if scenario.grid and white_box:
            return self._grid_study(data, seed, recorder)
        q = scenario.sampling_rate
        ledger = Ledger()
        losses, clips = [], []
        runs = scenario.grid or (scenario.hyperparameters,)
        if scenario.grid:  # without the tuner: the same grid, calibrated jointly by hand
            cal = accounting.calibrate(
                self.eps, self.delta, min(q, 1.0), scenario.steps, runs=len(runs), accountant=self.accountant
            )
            noise: dict[str, Any] = dict(noise_multiplier=cal.noise_multiplier)
        else:
            noise = dict(target_epsilon=self.eps, delta=self.delta, accountant=self.accountant)
        nu = math.nan
        # Black-box: no spy, the production path as it is (the spy draws a deferred query's whole vector).
        with spy_on_releases(recorder) if white_box else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore", SamplingWarning)  # its advice names options that audit lacks
            for k, hp in enumerate(runs):
                res = train(
                    audit_model(data.dim), (data.x, data.y), scenario.strategy, steps=scenario.steps, loss=linear_loss,
                    seed=stream_seed(seed, f"audit-run-{k}"), device="cpu", run_id=f"audit-{k}",
                    **_batch(q, int(data.x.shape[0])), **noise, **hp,
                )  # fmt: skip
                if res.diverged:
                    raise RuntimeError(f"audit training of {scenario.strategy} diverged; the audit is void")
                ledger.extend(res.ledger, run=f"audit-{k}")
                losses.append(loss_scores(res.final_params, data))
                clips += [float(r["clip"]) for r in res.history if "clip" in r]
                nu = res.plan.noise_multiplier
        return _Training(losses, ledger, clips, nu)

    def _grid_study(self, data: CanaryData, seed: int, recorder: ReleaseRecorder) -> _Training:
        """The grid study via ``run_study`` (budget = the claim, public selection: every release is training's)."""
        scenario, n = self.scenario, int(data.x.shape[0])
        keys = dict.fromkeys(k for hp in scenario.grid for k in hp)
        space = {k: list(dict.fromkeys(hp[k] for hp in scenario.grid if k in hp)) for k in keys}
        # A study takes a *named* loss: the MSE form of the same linear loss (see LinearLossUnderMSE).
        y = torch.zeros((n, 1), dtype=data.x.dtype)
        study = Study(
            data=(data.x, y, torch.zeros((4, data.dim), dtype=data.x.dtype), torch.zeros((4, 1), dtype=data.x.dtype)),
            model=ModelSpec(builder=LinearLossUnderMSE, options={"dim": data.dim}),
            strategies=(StrategyArm(scenario.strategy, space=space, fixed=dict(scenario.hyperparameters)),),
            training=TrainingSpec(steps=scenario.steps, loss="mse", **_batch(scenario.sampling_rate, n)),
            budget=BudgetSpec(epsilon=(self.eps,), delta=self.delta, accountant=self.accountant),
            method=MethodSpec("grid"),
            selection=SelectionSpec(mode="public", split="test", metric="mse", eval_every=scenario.steps),
            seeds=(0,),
            seed=int(seed % (2**31)),
            name="audit-grid",
        )
        with tempfile.TemporaryDirectory(prefix="dptune-audit-") as tmp, spy_on_releases(recorder):
            try:
                outcome = run_study(study, tmp, executor="local", progress=False)
                with Store(tmp, readonly=True) as store:
                    ledger = Ledger()
                    for e in store.ledger_entries():
                        ledger.record(e.event, e.label, count=e.count, components=e.components, run=e.run)
                    nu = float(store.runs()[0]["noise_multiplier"])
            finally:
                # The study cache keeps the tensors of every study data spec; ours are single-use.
                forget_cached(y)
        if not outcome.complete or not outcome.ledger_matches_plan or outcome.counts.get("done", 0) != scenario.runs:
            raise RuntimeError(f"the audited grid study did not complete as planned: {outcome.counts}")
        return _Training([], ledger, [], nu)


def _candidates(recorder: ReleaseRecorder) -> tuple[list[str], list[np.ndarray]]:
    """White-box candidate scores: all queries jointly, then each query alone (if several)."""
    names = recorder.query_names()
    labels, scores = ["llr:" + "+".join(names)], [recorder.llr_score(None)]
    if len(names) > 1:
        labels += [f"llr:{nm}" for nm in names]
        scores += [recorder.llr_score({nm}) for nm in names]
    return labels, scores


def run_audit(
    strategy: str,
    eps: float,
    delta: float = 1e-5,
    method: Method = "one-run",
    seed: int = 0,
    *,
    canaries: int | None = None,
    confidence: float = 0.95,
    threat_model: ThreatModel = "white-box",
    accountant: str = "pld",
    steps: int | None = None,
    sampling_rate: float | None = None,
    hyperparameters: dict[str, Any] | None = None,
    background: int = 500,
    on_progress: Callable[[str], None] | None = None,
) -> AuditResult:
    """Audit ``strategy`` (one of ``AUDITABLE``) at the claimed (``eps``, ``delta``): an ε lower bound holding
    with probability ≥ ``confidence``; one above ``eps`` refutes the claim. ``canaries``: m for one run
    (5,000) or trials per world (20,000); overrides of ``SCENARIOS`` are checked."""
    refuse_in_study("dptune audit", "`dptune audit`")  # under torchrun every rank would run and write it all
    scenario, n_canaries = _check_args(strategy, eps, delta, method, confidence, threat_model, canaries)
    scenario = _overridden(scenario, steps, sampling_rate, hyperparameters)
    rows = background + (n_canaries if method == "one-run" else min(n_canaries, TWO_WORLD_CHUNK))  # at most
    if delta * rows >= 1:  # `train` refused it after training, naming options that audit lacks (found in review)
        raise ConfigError(
            f"delta = {delta:g} is at least 1/n for the audit's own data (up to {rows:,} rows). "
            f"Fix: a δ below {1 / rows:.2g}, e.g. 1e-5."
        )
    t0 = time.perf_counter()
    say = on_progress or (lambda s: None)
    audit = _Audit(
        scenario, eps, delta, accountant, seed, confidence, background, say, CANARY_NORM_FACTOR * scenario.max_clip()
    )
    details: dict[str, Any] = {
        "strategy": strategy.lower(),
        "trained_strategy": scenario.strategy,
        "delta": delta,
        "threat_model": threat_model,
        "threat_model_text": THREAT_TEXT[threat_model],
        "hyperparameters": scenario.grid or scenario.hyperparameters,
        "sampling_rate": scenario.sampling_rate,
        "steps": scenario.steps,
        "runs": scenario.runs,
        "accountant": accountant,
        "seed": seed,
        "canary_norm": audit.canary_norm,
        "note": scenario.note,
    }
    if method == "one-run":
        lower, trainings = _one_run(audit, n_canaries, threat_model, details)
    else:
        lower, trainings = _two_worlds(audit, n_canaries, details)
    max_clip = max((c for t in trainings for c in t.clips), default=0.0)
    details.update(
        noise_multiplier=trainings[-1].nu,
        ledger_epsilon=max(t.ledger.epsilon(delta, accountant) for t in trainings),
        max_clip_seen=max_clip,
        canaries_saturated=bool(max_clip < audit.canary_norm),
        seconds=time.perf_counter() - t0,
    )
    if not details["canaries_saturated"]:
        raise RuntimeError(
            f"the clipping threshold reached {max_clip:.3g} ≥ canary norm {audit.canary_norm:.3g}: the canaries "
            "no longer saturate the sensitivity, so the white-box statistic is mis-specified"
        )
    return AuditResult(float(lower), float(eps), float(confidence), method, details)


def _overridden(
    scenario: Scenario, steps: int | None, sampling_rate: float | None, hyperparameters: dict[str, Any] | None
) -> Scenario:
    """The scenario with run_audit's overrides (checked)."""
    if steps is None and sampling_rate is None and not hyperparameters:
        return scenario
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"steps must be an integer ≥ 1, got {steps!r}.")
    if sampling_rate is not None:
        accounting.check_sampling_rate(sampling_rate)
    return dataclasses.replace(
        scenario,
        hyperparameters={**scenario.hyperparameters, **(hyperparameters or {})},
        sampling_rate=scenario.sampling_rate if sampling_rate is None else float(sampling_rate),
        steps=scenario.steps if steps is None else steps,
    )


def _one_run(audit: _Audit, m: int, threat_model: str, details: dict[str, Any]) -> tuple[float, list[_Training]]:
    """Steinke et al.'s test: m canaries, each present with probability ½, one training."""
    present = np.random.default_rng(stream_seed(audit.seed, "audit-membership")).random(m) < 0.5
    data = audit.data(present, "audit-data")
    rec = ReleaseRecorder(data.canary_coords)
    audit.say(f"training {audit.scenario.runs} run(s) with {m} canaries")
    run = audit.train(data, audit.seed, rec, white_box=threat_model == "white-box")
    if threat_model == "white-box":
        labels, scores = _candidates(rec)
    else:
        labels, scores = ["loss"], [np.sum(run.losses, axis=0)]
    split = stream_seed(audit.seed, "audit-split")
    b = bounds.one_run_bound(scores, present, audit.delta, audit.confidence, seed=split)
    details.update(
        canaries=m,
        included=int(present.sum()),
        canaries_evaluated=b.canaries,
        guesses=b.guesses,
        correct=b.correct,
        guesses_in=b.k_in,
        guesses_out=b.k_out,
        score=labels[b.score],
        scores=labels,
    )
    return b.epsilon, [run]


def _two_worlds(audit: _Audit, trials: int, details: dict[str, Any]) -> tuple[float, list[_Training]]:
    """Two worlds of ``trials`` each, in trainings of ``TWO_WORLD_CHUNK`` canary coordinates per world."""
    ins, outs, runs = [], [], []
    chunks = math.ceil(trials / TWO_WORLD_CHUNK)
    for c in range(chunks):
        size = min(TWO_WORLD_CHUNK, trials - c * TWO_WORLD_CHUNK)
        present = np.r_[np.ones(size, bool), np.zeros(size, bool)]
        data = audit.data(present, f"audit-data-{c}")
        rec = ReleaseRecorder(data.canary_coords)
        audit.say(f"training chunk {c + 1}/{chunks} ({size} trials per world)")
        runs.append(audit.train(data, stream_seed(audit.seed, f"chunk-{c}"), rec))
        labels, scores = _candidates(rec)
        ins.append([s[present] for s in scores])
        outs.append([s[~present] for s in scores])
    out_scores = [np.concatenate(c) for c in zip(*outs, strict=True)]
    in_scores = [np.concatenate(c) for c in zip(*ins, strict=True)]
    split = stream_seed(audit.seed, "audit-split")
    b = bounds.two_world_bound(out_scores, in_scores, audit.delta, audit.confidence, seed=split)
    details.update(
        trials_per_world=trials,
        trials_evaluated=(b.trials_out, b.trials_in),
        threshold=b.threshold,
        false_positives=b.false_positives,
        false_negatives=b.false_negatives,
        fpr_upper=b.fpr_upper,
        fnr_upper=b.fnr_upper,
        score=labels[b.score],
        scores=labels,
    )
    return b.epsilon, runs
