"""The isolation probe of the ghost path and of DP-ZO's batched losses (issue 23, items 2-4).

The clipping bound C is the sensitivity only if each example's released quantity (its clipped
gradient, its DP-ZO loss) depends on that example alone. vmap runs each example alone; the
ghost path and ``GradientOracle.losses`` run one batched forward and the user's batched loss,
so they are probed (``GradientOracle._probe``): row i is recomputed with every other row
replaced by a copy of row i, in the release's mode and random state, and must not change.

* one regression test per case of the issue (each passed the old code silently): a batch-
  statistics layer and a batch-reweighted loss, with 'auto' + Dropout and with forced 'ghost'
  (item 2); DP-ZO with a layer that mixes only in training (item 3); a first batch of one
  example, then a mixing model (item 4);
* controls: ordinary models (MLP with Dropout, a small CNN, the example transformer) are not
  refused, on 'auto', 'ghost' and DP-ZO, and the probe leaves the results and torch's random
  streams as they were;
* the schedule (a pass, then each call probed with chance 1/``PROBE_EVERY``, from OS entropy) and the final refusal;
* the mutant ``isolation check skipped`` (tests/mutants): with it, one added example moves the
  released clipped sum by more than C; without it the run is refused.
"""

from __future__ import annotations

import math
import random
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import load_example, params_of
from mutants import MUTANTS
from torch import nn
from torch.func import functional_call

import dptune
from dptune.errors import ConfigError
from dptune.gradients import ghost
from dptune.gradients.oracle import GradientOracle
from dptune.release.mechanisms import NoisyRelease

pytestmark = pytest.mark.usefixtures("one_thread")

REFUSED = "depends on other examples"


class BatchCentre(nn.Module):
    """A hand-written batch-statistics layer: parameter-free and not nn.BatchNorm, so
    ``check_model`` lets it through; every row depends on the whole batch."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a - a.mean(0, keepdim=True)


class CentreInTraining(BatchCentre):
    """Mixes examples in training mode only (an eval-mode check cannot see it)."""

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return super().forward(a) if self.training else a


class Switch(BatchCentre):
    """Mixes once switched on (a pipeline whose mixing starts after the first batches)."""

    on = False

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return super().forward(a) if self.on else a


def hard_mining(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Hard-example mining: each loss reweighted by softmax weights computed across the batch."""
    loss = F.cross_entropy(out, y, reduction="none")
    return loss * torch.softmax(loss.detach(), 0) * loss.shape[0]


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def mlp(mix: nn.Module | None = None, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), *([mix] if mix is not None else []), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 2)
    )


def data(n: int = 60, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g) * 2 + 1
    return x, (x[:, 0] > 1).long()


def train(model: nn.Module, strategy: str = "dpsgd", grad_method: str | None = None, loss=ce, **kw):
    return dptune.train(
        model, data(), strategy, steps=3, expected_batch_size=20, noise_multiplier=1.0, seed=0, device="cpu",
        lr=0.05, grad_method=grad_method, loss=loss, **kw,
    )  # fmt: skip


def assert_refused(exc: pytest.ExceptionInfo, fix: str = "grad_method='vmap'") -> None:
    msg = str(exc.value)
    assert REFUSED in msg and "Fix:" in msg and "reduction='none'" in msg and fix in msg
    assert not re.search(r"\d\.\d|e-\d", msg), "no values in the message: they are private"


# ----------------------------------------------------------------------------- item 2: the ghost path
@pytest.mark.parametrize(("grad_method", "dropout"), [("auto", 0.3), ("ghost", 0.0)], ids=["auto+dropout", "ghost"])
def test_a_mixing_pipeline_on_the_ghost_path_is_refused(grad_method: str, dropout: float) -> None:
    """The old self-check was skipped with an active Dropout and never ran for forced ghost: these
    released 1.09 to 5.89 C per added example. Now refused before the first release. A batch-reweighted
    user loss no longer needs the probe: it is computed on one example at a time (own.user_loss)."""
    m = mlp(BatchCentre(), dropout)
    released: list[str] = []
    with _spy(released), pytest.raises(ConfigError, match=REFUSED) as exc:
        train(m, "dpsgd", grad_method, ce)
    assert_refused(exc)
    assert released == []  # nothing left the gateway
    train(mlp(None, dropout), "dpsgd", grad_method, hard_mining)  # per example by construction: trains


# ----------------------------------------------------------------------------- item 3: DP-ZO in training mode
def test_dpzo_with_a_layer_that_mixes_only_in_training_is_refused() -> None:
    """The old DP-ZO check ran in eval mode; the releases run in training mode (2.62 C)."""
    released: list[str] = []
    with _spy(released), pytest.raises(ConfigError, match=REFUSED) as exc:
        train(mlp(CentreInTraining(), 0.2), "dpzo")
    assert_refused(exc, fix="without batch statistics")
    assert released == []


# ----------------------------------------------------------------------------- item 4: a first batch of one
@pytest.mark.parametrize("grad_method", ["auto", "ghost"])
def test_a_first_batch_of_one_example_proves_nothing(grad_method: str) -> None:
    """One example cannot show mixing: the old 'auto' check passed on it and kept ghost for good
    (3.65 C). Now a batch is computed on vmap until a probe on a batch of ≥ 3 has passed."""
    model = mlp(BatchCentre())
    oracle = GradientOracle(model, method=grad_method)
    p = params_of(model)
    x, y = data(8)
    for b in (1, 2):  # too small to probe: each example runs alone
        got = oracle(p, x[:b], y[:b])
        assert not isinstance(got, ghost.GhostGrads)
    with pytest.raises(ConfigError, match=REFUSED) as exc:
        oracle(p, x[2:7], y[2:7])
    assert_refused(exc)
    with pytest.raises(ConfigError, match=REFUSED):  # final: a retried step (or a good batch) is refused again
        oracle(p, x[:1], y[:1])


def test_dpzo_losses_are_computed_alone_until_a_probe_has_passed() -> None:
    model = mlp(BatchCentre())
    oracle = GradientOracle(model, ce)
    p = params_of(model)
    x, y = data(8)
    alone = torch.cat([oracle._plain_losses(p, x[j : j + 1], y[j : j + 1]) for j in range(2)])
    torch.testing.assert_close(oracle.losses(p, x[:2], y[:2]), alone)  # not the batch-centred ones
    with pytest.raises(ConfigError, match=REFUSED):
        oracle.losses(p, x[2:7], y[2:7])
    with pytest.raises(ConfigError, match=REFUSED):
        oracle.losses(p, x[:2], y[:2])


# ----------------------------------------------------------------------------- controls
class SmallCNN(nn.Module):
    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.norm(self.conv(x.reshape(-1, 1, 6, 6)))))
        return self.fc(h.flatten(1))


def _cnn_data(n: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 36, generator=g)
    return x, (x[:, :18].sum(1) > 0).long()


@pytest.mark.parametrize(
    ("strategy", "grad_method"), [("dpsgd", "auto"), ("dpsgd", "ghost"), ("oso", "auto"), ("dpzo", None)]
)
@pytest.mark.parametrize("make", [lambda: mlp(None, 0.3), SmallCNN], ids=["mlp+dropout", "cnn"])
def test_ordinary_models_are_not_refused(make, strategy: str, grad_method: str | None) -> None:
    model = make()
    x, y = data() if isinstance(model, nn.Sequential) else _cnn_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # 'auto' keeps the ghost path: no fallback warning
        r = dptune.train(
            model, (x, y), strategy, steps=3, expected_batch_size=20, noise_multiplier=1.0, seed=0, device="cpu",
            grad_method=grad_method,
        )  # fmt: skip
    assert len(r.history) == 3 and r.ledger.releases == 3


def test_the_example_transformer_is_not_refused() -> None:
    ex = load_example("transformer_text.py")
    torch.manual_seed(0)
    model = ex.GhostTransformer(50, 8, 16, 2, 1)
    x = torch.randint(0, 50, (40, 8))
    y = torch.randint(0, 2, (40,))
    for strategy, grad_method in (("dpsgd", "ghost"), ("dpsgd", "auto"), ("dpzo", None)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback to vmap
            r = dptune.train(
                model, (x, y), strategy, steps=2, expected_batch_size=10, noise_multiplier=1.0, seed=0, device="cpu",
                grad_method=grad_method,
            )  # fmt: skip
        assert r.ledger.releases == 2


@pytest.mark.parametrize("grad_method", ["auto", "ghost", "dpzo"])
def test_a_nan_row_drawn_by_the_probe_is_not_mixing(grad_method: str) -> None:
    """A non-finite example gives NaN in both computations: equal, not refused, ghost kept."""
    model = mlp()
    x, y = data(6)
    x[0, 1] = math.nan
    oracle = GradientOracle(model, method=None if grad_method == "dpzo" else grad_method)
    oracle._rows.randrange = lambda b: 0  # type: ignore[method-assign]  # the probed row is the NaN one
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        got = oracle.losses(params_of(model), x, y) if grad_method == "dpzo" else oracle(params_of(model), x, y)
    assert bool(got.isnan()[0]) if grad_method == "dpzo" else isinstance(got, ghost.GhostGrads)


def test_the_probe_changes_neither_the_result_nor_the_random_streams() -> None:
    """The probe replays the release's random state for its counterfactual and leaves torch's
    streams where the release left them: a probed call equals an unprobed one, draws included."""
    model = mlp(None, 0.5)
    p = params_of(model)
    x, y = data(12)
    fresh, warm = GradientOracle(model, method="ghost"), GradientOracle(model, method="ghost")
    warm(p, x, y)  # its probe passed
    warm._next_probe["grads"] = 10**9  # and the next is far away: its next call is not probed
    out = []
    for oracle in (fresh, warm):
        torch.manual_seed(5)
        g = oracle(p, x, y)
        out.append((g.norms, g.weighted_sum(torch.linspace(0.1, 1.0, 12)), torch.rand(3)))
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
    assert fresh._next_probe["grads"] > 1 and warm._next_probe["grads"] == 10**9  # the fresh one was probed


def test_mixing_that_starts_later_is_refused_at_a_later_probe() -> None:
    """After a pass, mixing that starts later is refused at a later probe; until then it is not seen
    (docs/privacy.md says so). A probe is due with chance 1/32 a call: 3,000 calls all unprobed: 1e-41."""
    switch = Switch()
    model = mlp(switch)
    oracle = GradientOracle(model, method="ghost")
    p = params_of(model)
    x, y = data(10)
    oracle(p, x, y)  # call 1: probed, passes
    switch.on = True
    with pytest.raises(ConfigError, match=REFUSED):
        for _ in range(3000):
            oracle(p, x, y)


def test_the_probe_schedule_has_no_phase_to_hide_in() -> None:
    """The calls between probes are geometric with mean PROBE_EVERY, drawn from OS entropy: a forward that
    mixes on a fixed phase of the call count (every 32nd call but one) meets probes as often as any other.
    The former fixed schedule (every 32nd call) fails every assertion here."""
    oracle = GradientOracle(mlp(), method="ghost")
    assert isinstance(oracle._rows, random.SystemRandom)
    gaps = torch.tensor([oracle._gap() for _ in range(20_000)], dtype=torch.float64)
    assert gaps.min() >= 1 and abs(gaps.mean() - GradientOracle.PROBE_EVERY) < 1.5  # SE 0.22
    assert abs(float((gaps == 1).double().mean()) - 1 / 32) < 0.006  # SE 0.0012
    phases = torch.bincount((gaps % 32).long(), minlength=32).double() / len(gaps)
    assert phases.max() < 0.06  # uniform over the 32 phases is 1/32 each, up to the geometric's slope


def test_a_loss_divided_by_the_batch_size_sees_a_batch_of_one() -> None:
    """Same-shape counterfactuals cannot see a dependence on the batch size alone: a user loss is now
    computed on one example at a time, so it sees B = 1 on every path, ghost included (no fallback)."""

    def per_batch(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, reduction="none") * (10.0 / out.shape[0])

    model = mlp()
    p = params_of(model)
    x, y = data(10)
    want = F.cross_entropy(functional_call(model, p, (x,)), y, reduction="none") * 10.0
    assert torch.allclose(GradientOracle(model, dptune.own.user_loss(per_batch)).losses(p, x, y), want)
    g = GradientOracle(model, dptune.own.user_loss(per_batch), method="ghost")(p, x, y)
    assert isinstance(g, ghost.GhostGrads) and torch.allclose(g.losses, want)


# ----------------------------------------------------------------------------- the mutant
class _spy:
    """Records the label and exact (pre-noise) value of every query that reaches the gateway."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.original = NoisyRelease.__dict__["release"]

    def __enter__(self) -> None:
        original, log = self.original, self.log

        def release(gw: NoisyRelease, *queries, label: str):
            log.extend((label, q.name, q.value, q.sensitivity) for q in queries)
            return original(gw, *queries, label=label)

        NoisyRelease.release = release  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        NoisyRelease.release = self.original  # type: ignore[method-assign]


def _released_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The clipped sum S(D) of one full-batch (q = 1) DP-SGD step on the ghost path, and C."""
    log: list = []
    with _spy(log):
        dptune.train(
            model, (x, y), "dpsgd", steps=1, expected_batch_size=x.shape[0], noise_multiplier=1.0, seed=0,
            device="cpu", grad_method="ghost", clip=0.5,
        )  # fmt: skip
    ((_, name, value, clip),) = log
    assert name == "gradient"
    return torch.cat([v.reshape(-1).double() for v in value.values()]), clip


def _sensitivity(model_fn) -> float:
    """‖S(D ∪ {x}) − S(D)‖ / C through the gateway; x an outlier (50× a typical example)."""
    x, y = data(30)
    x[29] *= 50
    s0, clip = _released_sum(model_fn(), x[:29], y[:29])
    s1, _ = _released_sum(model_fn(), x, y)
    return float((s1 - s0).norm()) / clip


def test_mutant_isolation_check_skipped_releases_more_than_c() -> None:
    with MUTANTS["isolation check skipped"]():
        moved = _sensitivity(lambda: mlp(BatchCentre()))
    assert moved > 3, moved  # the mixing pipeline's release moves by several C (6.0) ...
    with pytest.raises(ConfigError, match=REFUSED):  # ... and without the mutant it is refused
        _sensitivity(lambda: mlp(BatchCentre()))
    assert _sensitivity(lambda: mlp()) <= 1 + 1e-6  # the measurement itself: an isolated model keeps C
    assert math.isfinite(moved)


class WeakCentre(nn.Module):
    """A faint batch statistic (1e-4 of the batch mean): under √eps of float32, far over its eps.
    Summed over a batch of 512 it would move the clipped sum by ~0.05·C, unseen by a √eps test."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a + 1e-4 * a.mean(0, keepdim=True)


@pytest.mark.parametrize("grad_method", ["auto", "ghost"])
def test_a_faint_batch_statistic_is_refused(grad_method: str) -> None:
    """Same batch shape, same kernels: row i is recomputed exactly (CPU), so the probe's tolerance
    is 16·eps, not √eps (which let a 1e-4 mixing through)."""
    with pytest.raises(ConfigError, match=REFUSED):
        train(mlp(WeakCentre()), "dpsgd", grad_method)


class SwapFirstTwo(nn.Module):
    """Mixing that touches two rows only: rows 0 and 1 trade places (a sparse, hard-to-hit mixing)."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return torch.cat([a[:2].flip(0), a[2:]]) if a.shape[0] > 1 else a


def test_one_probe_checks_half_the_rows_so_sparse_mixing_is_caught_often() -> None:
    """Each probe keeps a random half of the rows (compared row by row) and replaces the rest by copies
    of row i: a swap of two rows out of 20 is seen when exactly one of them is kept (≈ 1/2), where
    checking row i alone saw it 2 times in 20. Over 200 fresh oracles: P(< 60 refusals) ≈ 1e-8."""
    x, y = data(20)
    refused = 0
    for _ in range(200):
        m = mlp(SwapFirstTwo())
        oracle = GradientOracle(m, ce, method="ghost")
        try:
            oracle(params_of(m), x, y)
        except ConfigError:
            refused += 1
    assert refused >= 60, refused
