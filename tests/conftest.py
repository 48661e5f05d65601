"""Shared fixtures and helpers for the engine's acceptance tests.

Helpers that several test files use live here as plain functions (imported with
``from conftest import ...``) next to the fixtures:

* small models (CNN, MLP, conv autoencoder) without cross-sample layers;
* stub privacy gateways: ``CaptureRelease`` (records the queries, adds NO noise: the
  deterministic update logic of a strategy can then be checked exactly) and
  ``RecordingRelease`` (a real ``NoisyRelease`` that also keeps every query and every
  noisy output, so the noise actually added is ``output − query.value``);
* ``run_strategy_steps``: drive a strategy's ``step`` directly, without ``train``;
* ``assert_gaussian_std``: a χ² test on the variance that must accept the configured σ
  AND reject 0.8σ and 1.25σ on the same samples (a power check built into every use).
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from dptune.gradients.oracle import GradientOracle, MaterializedGrads
from dptune.release.context import RunPlan
from dptune.release.ledger import Ledger
from dptune.release.mechanisms import DeferredSum, NoiseSource, NoisyRelease, SumQuery
from dptune.strategies.base import StepContext, Strategy

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from conftest import ...` in test files

Tensors = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- parallel runs
# The README's command runs the suite on two processes (pytest-xdist, ``-n 2 --dist loadgroup``). Tests that start
# a local Ray share one process: a second local Ray would join the first (``ray.init`` finds the latest cluster).
_RAY = re.compile(r"(?<![a-z])ray(?![a-z])", re.IGNORECASE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _RAY.search(item.nodeid):
            item.add_marker(pytest.mark.xdist_group("ray"))


if os.environ.get("PYTEST_XDIST_WORKER"):  # two processes on two cores: one thread each (tiny products, see one_thread)
    torch.set_num_threads(1)
    os.environ.pop("COLUMNS", None)  # xdist sets 80: the CLI's tables are checked as piped to a log (100 columns)


# ----------------------------------------------------------------------------- data
@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """X/shared/data for a repository checked out at X/main; skip the test when absent."""
    path = SHARED_DATA
    if not path.is_dir():
        pytest.skip(f"shared data directory not found at {path}")
    return path


@pytest.fixture
def data_env(shared_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The shared data as DPTUNE_DATA_DIR, offline: for tests that load datasets by name (presets)."""
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(shared_data_dir))
    monkeypatch.setenv("DPTUNE_OFFLINE", "1")
    return shared_data_dir


def load_mnist(shared_data_dir: Path, n_train: int = 5000, n_test: int = 2000):
    """First ``n_train`` MNIST training images and first ``n_test`` test images, in [0, 1]."""
    train = np.load(shared_data_dir / "mnist" / "train.npz")
    test = np.load(shared_data_dir / "mnist" / "test.npz")
    x = torch.tensor(train["x"][:n_train], dtype=torch.float32).unsqueeze(1) / 255.0
    y = torch.tensor(train["y"][:n_train], dtype=torch.long)
    xt = torch.tensor(test["x"][:n_test], dtype=torch.float32).unsqueeze(1) / 255.0
    yt = torch.tensor(test["y"][:n_test], dtype=torch.long)
    return (x, y), (xt, yt)


@pytest.fixture(scope="session")
def mnist5k(shared_data_dir: Path):
    return load_mnist(shared_data_dir)


# ----------------------------------------------------------------------------- models
class SmallCNN(nn.Module):
    """conv(1→4, 3×3, stride 2) → GroupNorm → tanh → conv(4→8, 3×3, stride 2) → linear(→10)."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self, side: int = 12, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        s = (side + 1) // 2
        s = (s + 1) // 2
        self.fc = nn.Linear(8 * s * s, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.conv1(x)))
        h = torch.relu(self.conv2(h))
        return self.fc(h.flatten(1))


class ConvAutoencoder(nn.Module):
    """conv(1→4, stride 2) → relu → conv-transpose(4→1, stride 2): a reconstruction model."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.dec = nn.ConvTranspose2d(4, 1, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.dec(torch.relu(self.enc(x))))


def mlp(inputs: int = 20, hidden: int = 16, classes: int = 5) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def pooled_mnist_mlp(hidden: int = 64) -> nn.Module:
    """The sanity-check model: 2×2 average pooling (28² → 14² inputs, no parameters) then an
    MLP 196 → hidden → 10. The Galli CNN is too slow for a CPU test; this one trains 5 epochs
    of 5,000 examples in seconds."""
    return nn.Sequential(nn.AvgPool2d(2), nn.Flatten(), nn.Linear(196, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def zero_grad_problem(inputs: int = 50, classes: int = 40, n: int = 64) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A bias-free linear classifier on all-zero inputs: every per-example gradient is exactly 0
    (∂ℓ/∂W = (∂ℓ/∂out)·xᵀ = 0), so whatever a strategy releases is pure noise, except the
    quantile count Σ(1[‖g‖ ≤ C] − ½) = B/2, which is known."""
    torch.manual_seed(0)
    model = nn.Linear(inputs, classes, bias=False)
    x = torch.zeros(n, inputs)
    y = torch.arange(n) % classes
    return model, x, y


def released_zero_grad_noise(device: str, steps: int = 1) -> tuple[torch.Tensor, float]:
    """``steps`` ``make_private`` steps (FixedClip, ν = 1.3, C = 0.7, L = 16) on ``zero_grad_problem``:
    the last released ``.grad`` of the weight (pure noise) and the std it should have, νC/L."""
    import dptune
    from dptune.release.privatizers import FixedClip

    model, x, y = zero_grad_problem(inputs=300, classes=100, n=64)
    nu, clip, L = 1.3, 0.7, 16.0
    model = model.to(device)
    private = dptune.make_private(
        model,
        (x, y),
        torch.optim.SGD(model.parameters(), lr=0.0),
        privatizer=FixedClip(clip),
        steps=steps,
        expected_batch_size=L,
        noise_multiplier=nu,
        seed=3,
        device=device,
    )
    for xb, yb in private.batches():
        private.backward(xb, yb)
    assert model.weight.grad is not None
    return model.weight.grad, nu * clip / L


def small_cnn(seed: int) -> nn.Sequential:
    """A Galli-shaped CNN on 1×10×10 inputs (Conv2d, MaxPool2d, strided Conv2d, AvgPool2d, two Linear)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        *(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 1)),
        *(nn.Conv2d(4, 6, 3, stride=2), nn.Tanh(), nn.AvgPool2d(2)),
        *(nn.Flatten(), nn.Linear(24, 5), nn.ReLU(), nn.Linear(5, 2)),
    )


def stacked_cnn_noise(device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step of 3 stacked CNN trials (a bias-free Conv2d(8, 32, 5) on all-zero images: every
    per-example conv gradient is exactly 0) with their own ν, C and lr: each trial's 6,400 conv
    weights move by its released noise alone. Returns that noise divided by its planned std
    lr·ν·C/L (N(0, 1) if right), and the raw moves per trial."""
    from dptune.vectorized import train_many

    nus, clips, lrs, L = [0.8, 1.5, 3.0], [0.5, 1.0, 2.0], [1.0, 0.5, 2.0], 16.0
    x, y = torch.zeros(64, 8, 8, 8), torch.arange(64) % 2
    cfgs = [{"lr": lr, "clip": c, "momentum": 0.0} for lr, c in zip(lrs, clips, strict=True)]
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Conv2d(8, 32, 5, bias=False), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128, 2))
        for _ in range(3)
    ]
    start = [m[0].weight.detach().clone() for m in models]
    runs = train_many(
        models, (x, y), "dpsgd", cfgs, [4, 5, 6], noise_multiplier=nus, steps=1, expected_batch_size=L, device=device
    )
    moves = [r.final_params["0.weight"].cpu() - w0 for r, w0 in zip(runs, start, strict=True)]
    scaled = [m.flatten() / (lr * nu * c / L) for m, lr, nu, c in zip(moves, lrs, nus, clips, strict=True)]
    return torch.cat(scaled).double(), moves


def params_of(model: nn.Module) -> Tensors:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def one_thread():
    """Many tiny matrix products: with two OpenMP threads on a busy 2-core machine each one
    waits for the other thread (measured 10x slower); results do not depend on it. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ----------------------------------------------------------------------------- gateways
@dataclass
class Captured:
    label: str
    queries: tuple[SumQuery, ...]
    outputs: list[Any]


class CaptureRelease:
    """A noise-FREE stand-in for ``NoisyRelease``: records each joint release in a ledger and
    in ``calls`` and returns the exact sums (or scripted values). Only for testing update
    logic; it is not private."""

    def __init__(self, sampling_rate: float = 1.0, script: Sequence[Sequence[Any]] | None = None):
        self.ledger = Ledger()
        self.sampling_rate = sampling_rate
        self.run = ""
        self.calls: list[Captured] = []
        self.script = list(script) if script is not None else None

    def release(self, *queries: SumQuery, label: str) -> list[Any]:
        from dptune import accounting

        nu = accounting.joint_noise_multiplier(q.noise_multiplier for q in queries)
        self.ledger.record(accounting.gaussian_step_event(nu, self.sampling_rate), label)
        if self.script is not None:
            outs = [_clone_value(v) for v in self.script[len(self.calls)]]
        else:
            outs = [_clone_value(q.value) for q in queries]
        self.calls.append(Captured(label, queries, outs))
        return outs


def _clone_value(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: t.detach().clone() for k, t in v.items()}
    return v.detach().clone() if isinstance(v, torch.Tensor) else torch.as_tensor(v)


class RecordingRelease(NoisyRelease):
    """The real gateway (ledger record, then Gaussian noise), keeping every call's queries and
    noisy outputs so that tests can read the noise actually added."""

    def __init__(self, ledger: Ledger, sampling_rate: float, noise: NoiseSource, run: str = "", **kwargs: Any):
        super().__init__(ledger, sampling_rate, noise, run, **kwargs)
        self.calls: list[Captured] = []

    def release(self, *queries: SumQuery, label: str) -> list[Any]:
        outs = super().release(*queries, label=label)
        self.calls.append(Captured(label, queries, outs))
        return outs

    def noise_of(self, call: int, query: int) -> torch.Tensor:
        """Flattened (output − exact value) of one query of one call. A deferred query's full
        noise vector is drawn here (``materialize``; refused once the strategy projected it)."""
        c = self.calls[call]
        out = c.outputs[query]
        if isinstance(out, DeferredSum):
            out = self.materialize(out)
        return flat(out) - flat(c.queries[query].value)


def flat(v: Any) -> torch.Tensor:
    if isinstance(v, dict):
        return torch.cat([t.reshape(-1).double() for t in v.values()])
    return torch.as_tensor(v).reshape(-1).double()


def run_plan(nu: float, q: float, L: float, steps: int, strategy: Any = None) -> RunPlan:
    """A ``RunPlan`` for unit tests that drive a strategy or privatizer by hand: n = L/q examples.
    ``strategy``: a strategy, a privatizer (chained with SGD) or None (DP-SGD)."""
    from dptune.release.privatizers import FixedClip, Privatizer
    from dptune.strategies import chain
    from dptune.updates import SGD

    if strategy is None or isinstance(strategy, Privatizer):
        strategy = chain(strategy or FixedClip(), SGD(0.1))
    return RunPlan(strategy, round(L / q), q, steps, nu)


@dataclass
class StepRun:
    params: Tensors
    state: Any
    metrics: list[dict[str, float]] = field(default_factory=list)
    params_history: list[Tensors] = field(default_factory=list)


def run_strategy_steps(
    strategy: Strategy,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    release: Any,
    noise_multiplier: float = 1.0,
    expected_batch_size: float | None = None,
    total_steps: int | None = None,
    loss: str = "cross_entropy",
    batches: Callable[[int], torch.Tensor] | None = None,
    grads: Callable[[int, Tensors], MaterializedGrads] | None = None,
    params: Tensors | None = None,
) -> StepRun:
    """Call ``strategy.step`` ``steps`` times with ``release`` as the gateway.

    ``batches(t)`` gives the batch indices of step t (default: the whole data);
    ``grads(t, params)`` may inject per-sample gradients directly (bypassing the model).
    """
    oracle = GradientOracle(model, loss)
    p = params if params is not None else params_of(model)
    p = strategy.prepare(p)
    n = int(x.shape[0])
    L = float(expected_batch_size if expected_batch_size is not None else n)
    run = run_plan(noise_multiplier, release.sampling_rate, L, total_steps or steps, strategy)
    strategy.validate_run(run)
    state = strategy.init(p, run)
    out = StepRun(p, state)
    for t in range(1, steps + 1):
        idx = batches(t) if batches is not None else torch.arange(n)
        ctx = StepContext(t=t, x=x[idx], y=y[idx], oracle=oracle, release=release, run=run)
        if grads is not None:
            ctx._grads = grads(t, p)
        p, state, m = strategy.step(p, state, ctx)
        out.metrics.append(m)
        out.params_history.append({k: v.detach().clone() for k, v in p.items()})
    out.params, out.state = p, flat_state(state)
    return out


def flat_state(state: Any) -> Any:
    """A composed strategy's state ({'privatizer': ..., 'update': ...}) as one dict, for assertions."""
    if isinstance(state, dict) and set(state) == {"privatizer", "update"}:
        return {**state["privatizer"], **state["update"]}
    return state


def gateway(sampling_rate: float, seed: int = 1234, plan: Any = None) -> RecordingRelease:
    ledger = Ledger.with_plan(plan) if plan is not None else Ledger()
    return RecordingRelease(ledger, sampling_rate, NoiseSource(seed))


# ----------------------------------------------------------------------------- statistics
ALPHA = 1e-4  # two-sided level of every variance test (seeded, so a fixed outcome; kept strict)


def variance_pvalue(samples: torch.Tensor | np.ndarray, sigma: float) -> float:
    """Two-sided p-value of H0: samples iid N(0, σ²), from S = Σ z²/σ² ~ χ²_n."""
    z = np.asarray(torch.as_tensor(samples).double().reshape(-1))
    n = z.size
    s = float((z**2).sum() / sigma**2)
    lower = stats.chi2.cdf(s, n)
    upper = stats.chi2.sf(s, n)
    return float(min(1.0, 2 * min(lower, upper)))


def gaussian_std_accepts(samples: torch.Tensor | np.ndarray, sigma: float, alpha: float = ALPHA) -> bool:
    """True when N(0, σ²) is not rejected: the χ² variance test AND a z-test of mean 0."""
    z = np.asarray(torch.as_tensor(samples).double().reshape(-1))
    mean_ok = abs(z.mean()) <= stats.norm.isf(alpha / 2) * sigma / math.sqrt(z.size)
    return bool(mean_ok and variance_pvalue(z, sigma) >= alpha)


def assert_gaussian_std(samples: torch.Tensor | np.ndarray, sigma: float, what: str = "noise") -> None:
    """The configured σ is accepted and the same test rejects 0.8σ and 1.25σ (power check)."""
    n = int(np.asarray(torch.as_tensor(samples)).size)
    emp = float(np.sqrt((np.asarray(torch.as_tensor(samples).double()) ** 2).mean()))
    assert gaussian_std_accepts(samples, sigma), (
        f"{what}: empirical std {emp:.6g} ≠ configured σ = {sigma:.6g} (n = {n})"
    )
    for wrong in (0.8 * sigma, 1.25 * sigma):
        assert not gaussian_std_accepts(samples, wrong), (
            f"{what}: test has no power: it accepts the wrong σ {wrong:.6g} with n = {n} samples; use more samples"
        )


TESTS = Path(__file__).resolve().parent  # tests/ (test files may sit in subfolders of it)
ROOT = TESTS.parent  # the repository
EXAMPLES = ROOT / "examples"
SHARED_DATA = ROOT.parent / "shared" / "data"  # X/shared/data for a checkout at X/main


def load_example(file: str, module: str | None = None) -> Any:
    """Import ``examples/<file>`` as a module (the examples are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module or Path(file).stem, EXAMPLES / file)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
