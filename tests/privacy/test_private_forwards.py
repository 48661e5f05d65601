"""No forward pass on private data may leave anything in the model's buffers.

A layer that updates a buffer in its forward (InstanceNorm with ``track_running_stats=True``, a
user layer keeping running statistics or a cache) would store exact, un-noised statistics of the
private batches in the model, which ``model.pt`` publishes. Two guards, for every strategy and
gradient path:

* ``check_model`` refuses layers with ``track_running_stats=True`` (like BatchNorm), naming the fix;
* every private forward runs on fresh copies of the buffers (discarded afterwards, so nothing
  written can reach the model or a later step) and a write is refused with a ``ConfigError``
  before the step's release.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CaptureRelease, params_of, run_plan
from torch import nn
from torch.func import functional_call

import dptune
from dptune import own
from dptune.errors import ConfigError
from dptune.gradients.oracle import GradientOracle, ScratchBuffers
from dptune.release.context import StepContext
from dptune.release.privatizers import FixedClip, ZerothOrderClip

pytestmark = pytest.mark.usefixtures("one_thread")

# (strategy, grad_method): every private path; 'auto' tries ghost first, then checks against vmap.
PATHS = [("dpzo", None), ("dpsgd", "ghost"), ("dpsgd", "auto"), ("dpsgd", "vmap"), ("oso", "auto"), ("nodp", None)]


def _data(n: int = 90) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 16, generator=g) * 2.0 + 5.0  # private features: mean ~5
    return x, (x.mean((1, 2)) > 5).long()


class Writer(nn.Module):
    """A parameter-free layer that stores the batch mean of its input in a buffer (the ghost
    path accepts it: it has no trainable parameters)."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("buf", torch.zeros(d))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        self.buf.copy_(a.mean(0))
        return a


class Constant(nn.Module):
    """A layer with a constant buffer (read, never written): must stay accepted."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * self.scale


def _train(model: nn.Module, strategy: str, grad_method: str | None, **kw) -> dptune.TrainResult:
    x, y = _data()
    private = {} if strategy == "nodp" else {"noise_multiplier": 1.0}
    return dptune.train(
        model, (x, y), strategy, steps=3, expected_batch_size=30, seed=0, device="cpu", lr=0.05,
        grad_method=grad_method, **private, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "norm",
    [
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        lambda: nn.InstanceNorm1d(3, track_running_stats=True),  # parameter-free: ghost would accept it
        lambda: nn.InstanceNorm2d(3, track_running_stats=True),
    ],
)
def test_running_statistics_layers_are_refused_with_the_fix_named(norm) -> None:
    layer = norm()
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(48, 2))
    with pytest.raises(ConfigError, match="track_running_stats") as exc:
        GradientOracle(model)
    assert "Fix:" in str(exc.value) and "GroupNorm" in str(exc.value) and "track_running_stats=False" in str(exc.value)
    # Without running statistics the same layer is per-example: accepted.
    layer.track_running_stats = False
    GradientOracle(model)


@pytest.mark.parametrize(("strategy", "grad_method"), PATHS)
def test_a_running_statistics_layer_is_refused_before_any_forward(strategy: str, grad_method: str | None) -> None:
    """train() refuses InstanceNorm(track_running_stats=True) for every strategy and path, and
    the layer's running statistics never saw the private data (they stay at their init)."""
    model = nn.Sequential(nn.InstanceNorm1d(3, affine=True, track_running_stats=True), nn.Flatten(), nn.Linear(48, 2))
    with pytest.raises(ConfigError, match="track_running_stats"):
        _train(model, strategy, grad_method)
    assert torch.equal(model[0].running_mean, torch.zeros(3)) and torch.equal(model[0].running_var, torch.ones(3))
    assert int(model[0].num_batches_tracked) == 0


@pytest.mark.parametrize(("strategy", "grad_method"), PATHS)
def test_a_buffer_written_in_forward_is_refused_and_never_reaches_the_model(
    strategy: str, grad_method: str | None
) -> None:
    model = nn.Sequential(nn.Flatten(), Writer(48), nn.Linear(48, 2))
    with pytest.raises(ConfigError, match=r"buffer.*1\.buf") as exc:
        _train(model, strategy, grad_method)
    assert "Fix:" in str(exc.value)
    assert torch.equal(model[1].buf, torch.zeros(48))  # the private batch mean was never stored


def test_a_buffer_write_is_refused_before_the_release() -> None:
    """The guard runs inside the privatizer's forwards: the step's release never happens."""
    x, y = _data(8)
    for priv in (ZerothOrderClip(), FixedClip()):
        model = nn.Sequential(nn.Flatten(), Writer(48), nn.Linear(48, 2))
        gw = CaptureRelease()
        run = run_plan(1.0, 1.0, 8.0, 1)
        ctx = StepContext(t=1, x=x, y=y, oracle=GradientOracle(model, method="vmap"), release=gw, run=run)
        with pytest.raises(ConfigError, match="buffer"):
            priv.privatize(params_of(model), priv.init(run), ctx, lr=0.1, label="t")
        assert gw.calls == [] and torch.equal(model[1].buf, torch.zeros(48))


def test_a_user_loss_check_does_not_write_the_models_buffers() -> None:
    """own.check_loss runs the model on a public dummy (zeros), never a private example, and stores nothing."""
    x, y = _data(4)
    model = nn.Sequential(nn.Flatten(), Writer(48), nn.Linear(48, 2))
    own.check_loss(lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"), model, x, y)
    assert torch.equal(model[1].buf, torch.zeros(48))


@pytest.mark.parametrize(("strategy", "grad_method"), PATHS)
def test_constant_buffers_are_accepted_and_left_as_they_are(strategy: str, grad_method: str | None) -> None:
    model = nn.Sequential(nn.Flatten(), Constant(48), nn.Linear(48, 2))
    before = model[1].scale
    r = _train(model, strategy, grad_method)
    assert len(r.history) == 3
    assert model[1].scale is before and torch.equal(before, torch.full((48,), 0.5))


def test_a_write_that_leaves_the_value_unchanged_is_accepted() -> None:
    """Only a changed value is refused (a layer re-filling a constant buffer is harmless)."""

    class Refill(Constant):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            self.scale.fill_(0.5)
            return a * self.scale

    model = nn.Sequential(nn.Flatten(), Refill(48), nn.Linear(48, 2))
    r = _train(model, "dpzo", None)
    assert len(r.history) == 3 and torch.equal(model[1].scale, torch.full((48,), 0.5))


# ----------------------------------------------------------------------------- second review
class LazyCache(nn.Module):
    """Registers a buffer on its first forward and stores the batch mean in it."""

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.zeros(a.shape[1:]))
        self.cache.copy_(a.mean(0))
        return a


class FrozenStat(nn.Module):
    """Keeps a statistic of its input in a frozen parameter (requires_grad=False), not a buffer."""

    def __init__(self, d: int):
        super().__init__()
        self.stat = nn.Parameter(torch.zeros(d), requires_grad=False)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.stat.copy_(a.mean(0))
        return a


def _private_loop(model: nn.Module, privatizer, **kw) -> dptune.PrivateTraining:
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return dptune.make_private(
        model, (x, y), opt, privatizer=privatizer, steps=4, expected_batch_size=30, noise_multiplier=1.0,
        delta=1e-5, device="cpu", **kw,
    )  # fmt: skip


@pytest.mark.parametrize("privatizer", [ZerothOrderClip, FixedClip])
def test_a_refusal_is_final_and_a_lazily_registered_buffer_is_removed(privatizer) -> None:
    """make_private yields the same batch again after a step that failed before its release: the
    retried step must be refused again, and the buffer the refused forward registered (holding the
    private batch mean) must not stay in the model."""
    model = nn.Sequential(nn.Flatten(), LazyCache(), nn.Linear(48, 2))
    private = _private_loop(model, privatizer())
    for _ in range(2):
        x, y = next(iter(private.batches()))
        with pytest.raises(ConfigError, match="cache"):
            private.step(x, y)
        assert "cache" not in dict(model.named_buffers())
    assert private.ledger.releases == 0


def test_a_buffer_registered_between_steps_is_guarded_too() -> None:
    """A buffer the user registers after the run started (here: after step 1) is picked up before
    the next forward, so a write to it is refused like any other (it used to be the model's own
    tensor, written unseen)."""
    model = nn.Sequential(nn.Flatten(), Writer(48), nn.Linear(48, 2))
    del model[1]._buffers["buf"]
    model[1].forward = lambda a: (model[1].buf.copy_(a.mean(0)), a)[1] if hasattr(model[1], "buf") else a
    private = _private_loop(model, FixedClip(1.0), grad_method="ghost")
    batches = private.batches()
    private.step(*next(batches))
    model[1].register_buffer("buf", torch.zeros(48))
    with pytest.raises(ConfigError, match="buf"):
        private.step(*next(batches))
    assert torch.equal(model[1].buf, torch.zeros(48)) and private.ledger.releases == 1


def test_buffers_rebound_or_moved_between_steps_are_read_fresh() -> None:
    """A buffer re-bound (``layer.scale = t``) or converted (``model.double()``) between forwards is
    the one the next forward reads: the scratch copies are never of a stale tensor."""
    from dptune.gradients.persample import ScratchBuffers

    model = nn.Sequential(nn.Flatten(), Constant(4))
    scratch = ScratchBuffers(model)
    with scratch() as b:
        assert torch.equal(b["1.scale"], torch.full((4,), 0.5))
    model[1].scale = torch.full((4,), 2.0)
    with scratch() as b:
        assert torch.equal(b["1.scale"], torch.full((4,), 2.0))
    model.double()
    with scratch() as b:
        assert b["1.scale"].dtype == torch.float64


@pytest.mark.parametrize(("strategy", "grad_method"), [("dpzo", None), ("dpsgd", "ghost"), ("dpsgd", "vmap")])
def test_a_statistic_kept_in_a_frozen_parameter_is_refused(strategy: str, grad_method: str | None) -> None:
    model = nn.Sequential(nn.Flatten(), FrozenStat(48), nn.Linear(48, 2))
    with pytest.raises((ConfigError, RuntimeError), match="stat|vmap|inplace|in-place"):
        _train(model, strategy, grad_method)


@pytest.mark.parametrize("spectral", ["parametrizations", "hook"])
@pytest.mark.parametrize(("strategy", "grad_method"), [("dpzo", None), ("dpsgd", "vmap"), ("dpsgd", "auto")])
def test_spectral_normalisation_trains(spectral: str, strategy: str, grad_method: str | None) -> None:
    """Spectral norm's power-iteration vectors are updated in forward from the weights alone (no
    data): they are passed through, not refused (the first version of the guard refused them)."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 2)
    lin = (
        nn.utils.parametrizations.spectral_norm(lin) if spectral == "parametrizations" else nn.utils.spectral_norm(lin)
    )
    r = _train(nn.Sequential(nn.Flatten(), lin), strategy, grad_method)
    assert len(r.history) == 3


def test_dpzo_accepts_functional_dropout() -> None:
    """Randomness outside nn.Dropout (F.dropout(training=self.training), as in OPT): the isolation
    check runs in eval mode, so it is not mistaken for mixing examples."""

    class FDrop(nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(a, 0.3, training=self.training)

    torch.manual_seed(0)
    r = _train(nn.Sequential(nn.Flatten(), FDrop(), nn.Linear(48, 2)), "dpzo", None)
    assert len(r.history) == 3


def test_a_buffer_written_in_a_backward_hook_is_refused_and_undone() -> None:
    """A tensor hook writes the model's own buffer during the backward (after the forward's
    copies were swapped out): refused, and the value from before is put back."""

    class HookStat(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.register_buffer("gstat", torch.zeros(d))

        def forward(self, a: torch.Tensor) -> torch.Tensor:
            def keep(g: torch.Tensor) -> None:
                self.gstat.copy_(g.mean(0))

            if a.requires_grad:
                a.register_hook(keep)
            return a

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 8), HookStat(8), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match="gstat"):
        _train(model, "dpsgd", "ghost")
    assert torch.equal(model[2].gstat, torch.zeros(8))


def test_a_write_before_a_failure_is_refused() -> None:
    """Found in review: the checks now run when the forward raised too: a write before the failure is refused."""

    class WriteThenFail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(48))

        def forward(self, a: torch.Tensor) -> torch.Tensor:
            self.seen.copy_(a.mean(0))
            return a @ torch.ones(3, 3)

    model = nn.Sequential(nn.Flatten(), WriteThenFail(), nn.Linear(48, 2))
    scratch = ScratchBuffers(model)
    failed = r"seen during a pass on private data"
    with pytest.raises(ConfigError, match=failed), scratch() as buffers:
        functional_call(model, buffers, (torch.randn(4, 48),))
    assert torch.equal(model[1].seen, torch.zeros(48))
