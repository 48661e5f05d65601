"""``make_private``'s guards against non-private training in your own loop (privacy audit).

* an optimizer closure runs inside ``optimizer.step()``, after the pre-step hook: a closure that
  calls ``loss.backward()`` would step on the exact gradient, so a closure is refused (and
  L-BFGS, which always needs one, up front), before any parameter changes;
* ``backward(x, y)`` takes the batch ``batches()`` yielded: an ``x`` of the right length with the
  yielded ``y`` (e.g. B copies of one example: sensitivity B·C) is refused;
* a batch whose targets hold NaN is still the yielded batch (NaN ≠ NaN must not refuse it);
* a step that fails before its release neither consumes the batch nor counts as a step.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dptune
from dptune.errors import ConfigError
from dptune.release.privatizers import FixedClip, ZerothOrderClip

KW = {"steps": 3, "expected_batch_size": 30, "noise_multiplier": 1.0, "delta": 1e-5, "device": "cpu"}


def _problem(n: int = 120, d: int = 5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(1)
    return nn.Linear(d, 2), x, y


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p.detach(), before[k]) for k, p in model.named_parameters())


# ----------------------------------------------------------------------------- 1. closures
def test_lbfgs_is_refused_before_training_and_the_error_names_the_fix() -> None:
    model, x, y = _problem()
    before = _snapshot(model)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    with pytest.raises(ConfigError, match="L-BFGS") as err:
        dptune.make_private(model, (x, y), opt, **KW)
    assert "Fix:" in str(err.value) and "without a closure" in str(err.value)
    assert _unchanged(model, before)


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_a_closure_passed_to_optimizer_step_is_refused_before_it_runs(how: str) -> None:
    """The audit's bypass: zero_grad + loss.backward() inside the closure replaced the released
    gradient by the exact one after the pre-step hook had passed. Refused before the closure runs
    or any parameter moves; the run then goes on with optimizer.step() and no closure."""
    model, x, y = _problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    private = dptune.make_private(model, (x, y), opt, **KW)
    ran = []
    for xb, yb in private.batches():
        opt.zero_grad()
        private.backward(xb, yb)
        before = _snapshot(model)

        def closure(xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
            ran.append(1)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            return loss

        with pytest.raises(ConfigError, match="closure") as err:
            opt.step(closure) if how == "positional" else opt.step(closure=closure)
        msg = str(err.value)
        assert "Fix:" in msg and "optimizer.step() without a closure" in msg and "L-BFGS" in msg
        assert ran == [] and _unchanged(model, before)
        opt.step()  # the released gradient is still in .grad: the documented step goes on
        assert not _unchanged(model, before)
    assert private.ledger.releases == private.t == 3
    opt.step(None)  # an explicit "no closure" is fine


# ----------------------------------------------------------------------------- 2. x is the yielded x
def test_an_x_of_your_choosing_with_the_yielded_y_is_refused() -> None:
    """The audit's substitution: B copies of one example with the yielded y passed the old
    check (length and y only). Refused; the yielded x (or an equal copy) passes."""
    model, x, y = _problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, **KW)
    it = private.batches()
    xb, yb = next(it)
    forged = x[7].expand_as(xb).clone()
    with pytest.raises(ConfigError, match="batches\\(\\) just yielded") as err:
        private.backward(forged, yb)
    assert "Fix:" in str(err.value) and "__getitem__" in str(err.value)  # where augmentation belongs
    with pytest.raises(ConfigError, match="batches\\(\\) just yielded"):
        private.backward(xb + 0.01, yb)  # a transform of the batch is not the batch
    with pytest.raises(ConfigError, match="batches\\(\\) just yielded"):
        private.backward(xb.double(), yb)
    assert private.t == 0 and private.ledger.releases == 0  # refusals spend nothing
    private.backward(xb, yb)  # the yielded batch itself
    xb, yb = next(it)
    private.backward(xb.clone(), yb.clone())  # an equal copy is the same batch
    assert private.t == private.ledger.releases == 2


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_several_inputs_must_be_the_yielded_ones_leaf_by_leaf(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(120, 3, generator=g), torch.randn(120, 2, generator=g)
    y = (a[:, 0] > 0).long()

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(2, 2)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.a(a) + self.b(b)

    model = Two()
    x = (a, b) if kind == "tuple" else {"a": a, "b": b}
    private = dptune.make_private(model, (x, y), torch.optim.SGD(model.parameters(), lr=0.1), **KW)
    for i, (xb, yb) in enumerate(private.batches()):
        leaves = list(xb) if kind == "tuple" else [xb["a"], xb["b"]]
        forged = [leaves[0], b[:1].expand_as(leaves[1]).clone()]  # the second input swapped
        bad = tuple(forged) if kind == "tuple" else {"a": forged[0], "b": forged[1]}
        with pytest.raises(ConfigError, match="batches\\(\\) just yielded"):
            private.step(bad, yb)
        if i == 0:
            private.step(xb, yb)  # as yielded
        elif kind == "tuple":
            private.step((leaves[0], leaves[1].clone()), yb)  # rebuilt from the same leaves
        else:
            private.step({"b": leaves[1].clone(), "a": leaves[0]}, yb)
    assert private.ledger.releases == 3


# ----------------------------------------------------------------------------- 3. NaN targets
def test_a_batch_with_nan_targets_is_accepted() -> None:
    """torch.equal(y, y) is False when y holds NaN: such a batch used to be refused forever."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=g)
    y = x[:, 0].clone()
    y[::2] = float("nan")  # e.g. missing targets, masked in the loss

    def masked_mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        keep = ~torch.isnan(t)
        return ((out[:, 0] - torch.nan_to_num(t)) ** 2) * keep

    torch.manual_seed(1)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, loss=masked_mse, **KW)
    saw_nan = False
    for i, (xb, yb) in enumerate(private.batches()):
        saw_nan |= bool(torch.isnan(yb).any())
        opt.zero_grad()
        private.backward(xb, yb if i == 0 else yb.clone())  # the yielded y, then an equal copy
        opt.step()
    assert saw_nan and private.ledger.releases == private.t == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------- 4. a failed step
def test_a_step_that_fails_before_its_release_takes_no_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception before the release (out of memory, say) consumed the batch and counted a
    step with no ledger entry (steps_taken > releases). Now nothing moves: the same batch comes
    back and the run goes on."""
    model, x, y = _problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, privatizer=FixedClip(1.0), **KW)
    original = FixedClip.privatize
    calls = []

    def fails_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FixedClip, "privatize", fails_once)
    xb, yb = next(iter(private.batches()))
    with pytest.raises(RuntimeError, match="out of memory"):
        private.backward(xb, yb)
    assert private.t == private.ledger.releases == 0
    assert private.result().steps_taken == private.ledger.releases == 0
    again_x, again_y = next(iter(private.batches()))
    assert again_x is xb and again_y is yb  # the unused batch, not a fresh draw
    for xb, yb in private.batches():
        opt.zero_grad()
        private.backward(xb, yb)
        opt.step()
    assert private.result().steps_taken == private.ledger.releases == private.steps == 3
    assert math.isfinite(private.epsilon())


def test_a_step_that_fails_after_its_release_counts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the release is recorded the batch is spent: the step counts (steps_taken equals the
    ledger's releases) and the next batch is a fresh draw."""
    model, x, y = _problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, privatizer=FixedClip(1.0), **KW)
    original = FixedClip.privatize
    calls = []

    def fails_after_first_release(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("failure after the release (simulated)")
        return out

    monkeypatch.setattr(FixedClip, "privatize", fails_after_first_release)
    xb, yb = next(iter(private.batches()))
    with pytest.raises(RuntimeError, match="after the release"):
        private.backward(xb, yb)
    assert private.t == private.ledger.releases == 1
    with pytest.raises(ConfigError, match="batches\\(\\) just yielded"):
        private.backward(xb, yb)  # spent: not twice
    for xb, yb in private.batches():
        opt.zero_grad()
        private.backward(xb, yb)
        opt.step()
    assert private.result().steps_taken == private.ledger.releases == 3


# ----------------------------------------------------------------------------- review: model changes, two optimizers
def _mlp() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    _, x, y = _problem()
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(x.shape[1], 4), nn.Tanh(), nn.Linear(4, 2)), x, y


@pytest.mark.parametrize("change", ["swap", "hook", "instance forward"])
def test_a_model_changed_after_make_private_is_refused(change: str) -> None:
    """A batch-mixing module swapped in, or a hook, after the first step: the isolation probe runs every 32
    steps only, so the change is refused at the next release (it released a sum moving 9.6·C before)."""
    model, x, y = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, **KW)
    batches = iter(private.batches())
    private.step(*next(batches))
    if change == "swap":
        model[1] = nn.BatchNorm1d(model[0].out_features, affine=False, track_running_stats=False)
    elif change == "hook":
        model[1].register_forward_hook(lambda mod, i, o: o - o.mean(0, keepdim=True))
    else:
        model[1].forward = lambda a: a - a.mean(0, keepdim=True)  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="the model changed since make_private"):
        private.step(*next(batches))
    assert private.ledger.releases == 1


def test_a_second_optimizer_cannot_step_an_exact_gradient() -> None:
    """Fine-tuning with two optimizers (body and head), one given to make_private: a loss.backward() put the
    exact gradient in the head's .grad, which the other optimizer stepped. Refused where it lands."""
    model, x, y = _mlp()
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), body, **KW)
    xb, yb = next(iter(private.batches()))
    private.backward(xb, yb)
    before = model[2].weight.detach().clone()
    with pytest.raises(ConfigError, match="backward pass reached a trainable parameter"):
        nn.functional.cross_entropy(model(xb), yb).backward()
    head.step()  # what it holds is never the exact gradient
    released = model[2].weight.grad
    assert released is None or torch.equal(model[2].weight, before - 0.1 * released)


def test_a_frozen_parameter_stepped_on_its_exact_gradient_is_refused() -> None:
    """Found in review: the body frozen at make_private was unfrozen, trained by backward(inputs=...) on the private
    batch with a second optimizer, and frozen again between two checks; the run went on and result() certified it.
    It holds a gradient: the next backward and result() refuse (your own writes, an EMA teacher, stay yours)."""
    model, x, y = _mlp()
    model[0].requires_grad_(False)
    private = dptune.make_private(model, (x, y), torch.optim.SGD(model[2].parameters(), lr=0.1), **KW)
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    batches = iter(private.batches())
    xb, yb = next(batches)
    private.step(xb, yb)
    model[0].requires_grad_(True)
    nn.functional.cross_entropy(model(xb), yb).backward(inputs=list(model[0].parameters()))
    body.step()
    model[0].requires_grad_(False)
    with pytest.raises(ConfigError, match="frozen parameter.*0.weight.*got a gradient"):
        private.result()
    with pytest.raises(ConfigError, match="a frozen one given a gradient"):
        private.step(*next(batches))


def test_after_the_plan_or_close_the_model_and_optimizer_are_yours_again() -> None:
    """Found in review: a run's hooks stayed for good, so after early stopping any loss.backward() on the model, and
    after the plan any public step of the same optimizer, was refused. The last release's step is still checked."""
    model, x, y = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, **KW)
    for xb, yb in private.batches():
        private.backward(xb, yb)
        if private.t == KW["steps"]:
            nn.functional.cross_entropy(model(xb), yb).sum().detach()  # looking is fine
        opt.step()
    nn.functional.cross_entropy(model(x), y).backward()  # public data now, say: yours
    opt.step()
    early = dptune.make_private(model, (x, y), opt, **KW)
    early.step(*next(iter(early.batches())))
    with pytest.raises(ConfigError, match="backward pass reached a trainable parameter"):
        nn.functional.cross_entropy(model(x), y).backward()
    early.close()  # early stopping: the run ends here, its result stays
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert early.result().steps_taken == 1


def test_backward_inside_inference_mode_is_refused_before_a_release() -> None:
    """Found in review: it spent a release, raised torch's error, and left a read-only scratch buffer that broke every
    later run in the process. Now one ConfigError before anything is released; the next runs are unaffected."""
    model, x, y = _problem()
    private = dptune.make_private(model, (x, y), torch.optim.SGD(model.parameters(), lr=0.1), **KW)
    xb, yb = next(iter(private.batches()))
    with torch.inference_mode(), pytest.raises(ConfigError, match="inference_mode"):
        private.backward(xb, yb)
    assert private.ledger.releases == 0
    from dptune.gradients import norm_bounds

    norm_bounds._SCRATCH.buf = None
    with torch.inference_mode():  # the host scratch buffer first made in inference mode ...
        norm_bounds.wide_mm(torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 5))
    private.step(xb, yb)  # ... is replaced outside it
    assert private.ledger.releases == 1


@pytest.mark.parametrize("off", [torch.no_grad, lambda: torch.set_grad_enabled(False)])
def test_a_step_inside_no_grad_is_refused_before_a_release(off) -> None:  # noqa: ANN001
    """Found in review: under torch.no_grad() a step spent a release (vmap's gradients ignore it), or, on a model run
    one example at a time, failed with a misleading BatchNorm "Fix". Now one ConfigError before anything is released."""
    model, x, y = _problem()
    private = dptune.make_private(model, (x, y), torch.optim.SGD(model.parameters(), lr=0.1), **KW)
    xb, yb = next(iter(private.batches()))
    with off(), pytest.raises(ConfigError, match=r"need autograd.*Fix: call it outside torch.no_grad\(\)"):
        private.step(xb, yb)
    assert private.ledger.releases == 0
    private.step(xb, yb)  # the same batch: not spent
    assert private.ledger.releases == 1
    zo = dptune.make_private(model, (x, y), torch.optim.SGD(model.parameters(), lr=0.1), privatizer=ZerothOrderClip(),
                             **KW)  # fmt: skip
    with off():  # DP-ZO needs no gradient: as before
        zo.step(*next(iter(zo.batches())))
    assert zo.ledger.releases == 1


def test_a_closed_or_finished_run_releases_nothing_more_and_certifies_its_own_parameters() -> None:
    """Found in review (a regression of close()): after close(), backward() went on releasing with every check gone,
    and result() certified whatever was trained after, exactly; after the plan, the same. Now a closed run refuses to
    release, and result() holds the parameters of the moment the run ended."""
    model, x, y = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, **KW)
    batches = iter(private.batches())
    private.step(*next(batches))
    private.close()
    at_close = _snapshot(model)
    with pytest.raises(ConfigError, match="this run was closed"):
        private.backward(*next(batches))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()  # exact training after the run: yours, not certified
    opt.step()
    assert all(torch.equal(v, at_close[k]) for k, v in private.result().final_params.items())
    finished = dptune.make_private(model, (x, y), opt, **KW)
    for xb, yb in finished.batches():
        finished.step(xb, yb)
    at_end = _snapshot(model)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(torch.equal(v, at_end[k]) for k, v in finished.result().final_params.items())


def test_a_gradient_a_frozen_parameter_held_before_make_private_is_no_refusal() -> None:
    """Found in review (a regression): pretrain, freeze the trunk, make_private with a head-only optimizer: the trunk's
    old .grad refused the first step. Only a gradient given during the run is refused."""
    model, x, y = _mlp()
    nn.functional.cross_entropy(model(x), y).backward()  # public pretraining, say: every .grad set
    model[0].requires_grad_(False)
    private = dptune.make_private(model, (x, y), torch.optim.SGD(model[2].parameters(), lr=0.1), **KW)
    for xb, yb in private.batches():
        private.step(xb, yb)
    assert private.result().steps_taken == KW["steps"]


def test_half_precision_inputs_of_a_float32_model_under_autocast_still_train() -> None:
    """Autocast is off inside every private computation (its bound); bfloat16 inputs of a float32 model are then
    computed in float32, as autocast would (found in review: refused as a model failing on one example)."""
    model, x, y = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x.bfloat16(), y), opt, **KW)
    for xb, yb in private.batches():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            private.backward(xb, yb)
        opt.step()
    assert private.result().steps_taken == KW["steps"]
