"""The building block: privatizers × update rules, ``chain``, and a private step in your own loop.

* every privatizer composes with every update rule, and the executed ledger is the planned one;
* the named strategies are compositions (``parts``) and ``make_strategy('a+b')`` routes
  hyperparameters to the right part;
* the privacy boundary is structural: only ``dptune/release/privatizers.py`` reads per-sample
  gradients or calls the gateway among the step code;
* ``make_private``: the same run as ``dptune.train`` for the same seed (bit for bit with a
  dptune update rule, to float tolerance with the equivalent torch optimizer), the noise of
  the released ``.grad`` has std νC/L (and not 0.9× or 1.1× that), the plan is enforced.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from conftest import released_zero_grad_noise
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from scipy import stats
from torch import nn
from tune_helpers import make_study

import dptune
from dptune import accounting
from dptune.errors import BudgetExceededError, ConfigError
from dptune.release.privatizers import PRIVATIZERS, FixedClip, NonPrivate, OSOClip, QuantileClip, ZerothOrderClip
from dptune.strategies import STRATEGIES, Composed, make_strategy, strategy_signature
from dptune.updates import ADADP, SGD, UPDATES, Adam, AdamWOSM, OSORate

SRC = Path(dptune.__file__).parent


def _problem(n: int = 120, d: int = 6, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, k)), x, y


PRIVATE = [
    FixedClip(0.5),
    QuantileClip(initial_clip=0.5, count_noise_std=5.0),
    OSOClip(initial_clip=0.5, clip_lr=0.05),
    ZerothOrderClip(0.5),
]
UPDATE_RULES = [SGD(0.2, 0.5), Adam(0.01), AdamWOSM(1e-3), OSORate(0.2, 0.05), ADADP(0.05)]


@pytest.mark.parametrize("privatizer", PRIVATE, ids=lambda p: p.name)
@pytest.mark.parametrize("update", UPDATE_RULES, ids=lambda u: u.name)
def test_every_privatizer_composes_with_every_update_rule(privatizer, update) -> None:
    model, x, y = _problem()
    strategy = dptune.chain(privatizer, update)
    assert strategy.name == f"{privatizer.name}+{update.name}" and strategy.private
    r = dptune.train(
        model,
        (x, y),
        strategy,
        steps=6,
        expected_batch_size=40,
        noise_multiplier=1.5,
        seed=1,
        device="cpu",
        accountant="rdp",
    )
    assert r.ledger.releases == 6
    assert r.ledger.matches(r.plan.event())
    assert all(math.isfinite(float(v.abs().max())) for v in r.final_params.values())
    clips = [row["clip"] for row in r.history]
    if isinstance(privatizer, FixedClip | ZerothOrderClip):
        assert set(clips) == {0.5}
    else:  # adaptive C: it moves from released values
        assert len(set(clips)) > 1
    # Independent reference: dp_accounting's RDP accountant on the textbook DP-SGD event.
    ref = rdp.RdpAccountant().compose(
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(40 / 120, dp_event.GaussianDpEvent(1.5)), 6)
    )
    assert r.epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)


def test_oso_clip_with_adam_learns_c_and_trains() -> None:
    """The issue's example composition: OSO's online C with Adam (not expressible before)."""
    model, x, y = _problem(n=400)
    r = dptune.train(
        model,
        (x, y),
        "oso+adam",
        steps=60,
        expected_batch_size=80,
        noise_multiplier=0.8,
        seed=2,
        device="cpu",
        eval_data=(x, y),
        eval_every=20,
        lr=0.02,
        initial_clip=0.05,
        clip_lr=0.05,
    )
    clips = [row["clip"] for row in r.history]
    assert clips[0] == 0.05 and clips[-1] > 0.2  # C grew from a far-too-small start
    assert r.best_metric is not None and r.best_metric > 0.6
    assert r.plan.strategy.config()["strategy"] == "oso+adam"


def test_named_strategies_are_compositions_of_their_parts() -> None:
    expected = {
        "dpsgd": ("fixed", "sgd"),
        "quantile": ("quantile", "sgd"),
        "oso": ("oso", "oso_rate"),
        "dpadam": ("fixed", "adam"),
        "adamwosm": ("fixed", "adamwosm"),
        "dpgd": ("fixed", "sgd"),
        "adadp": ("fixed", "adadp"),
        "nodp": ("none", "sgd"),
        "dpzo": ("zo", "sgd"),
    }
    assert set(expected) == set(STRATEGIES)
    for name, (p, u) in expected.items():
        s = make_strategy(name)
        assert isinstance(s, Composed)
        assert (s.privatizer.name, s.update_rule.name) == (p, u)


def test_a_named_strategy_is_a_recipe_over_chain() -> None:
    """Issue 26: dpadam is fixed+adam apart from its name (same parts, hyperparameters, run), and
    every named strategy's signature is its parts' fields: a default not re-set by the recipe is
    the part's, and each hyperparameter reaches the part that takes it."""
    kw = {"lr": 0.01, "clip": 0.5, "beta2": 0.99}
    named, chained = make_strategy("dpadam", **kw), make_strategy("fixed+adam", **kw)
    assert named.parts() == chained.parts() and named.name == "dpadam"
    assert {k: v for k, v in named.config().items() if k != "strategy"} == {
        k: v for k, v in chained.config().items() if k != "strategy"
    }
    torch.manual_seed(0)
    x, y = torch.randn(60, 4), torch.randint(0, 2, (60,))
    runs = []
    for s in (named, chained):
        torch.manual_seed(1)  # the same initial model
        runs.append(dptune.train(nn.Linear(4, 2), (x, y), s, steps=3, expected_batch_size=20,
                                 noise_multiplier=1.0, seed=1, device="cpu", progress=False))  # fmt: skip
    torch.testing.assert_close(runs[0].final_params, runs[1].final_params, rtol=0, atol=0)
    for name, cls in STRATEGIES.items():
        s = cls()
        for part in s.parts():
            for k, v in part.config().items():
                if k in cls.hyperparameters:
                    assert getattr(s, k) == v, (name, k)
    # one alias table, read in each place for the name that exists there
    assert strategy_signature("fixed_threshold")[0] == "dpsgd"
    assert strategy_signature("fixed_threshold+momentum")[0] == "fixed+sgd"
    assert strategy_signature(" Online ")[0] == "oso" and strategy_signature("online+oso_rho")[0] == "oso+oso_rate"
    assert strategy_signature("sgd")[0] == "nodp" and strategy_signature("nodp+sgd")[0] == "none+sgd"


def test_composition_by_name_routes_each_hyperparameter_to_its_part() -> None:
    s = make_strategy("oso+oso_rate", lr=0.3, initial_clip=0.7, rule="additive", lr_lr=0.01)
    assert s.privatizer == OSOClip(initial_clip=0.7, rule="additive")
    assert s.update_rule == OSORate(lr=0.3, lr_lr=0.01, rule="additive")
    assert make_strategy("quantile+adam", target_quantile=0.7, lr=0.01).privatizer.target_quantile == 0.7
    rebuilt = make_strategy(s.config()["strategy"], **{k: v for k, v in s.config().items() if k != "strategy"})
    assert rebuilt == s  # config() is flat and rebuilds the same strategy
    assert strategy_signature("none+adam")[2] is False and not make_strategy("none+adam").private
    with pytest.raises(ConfigError, match="no hyperparameter"):
        make_strategy("fixed+adam", momentum=0.9)
    with pytest.raises(ConfigError, match="privatizer in"):
        make_strategy("fixed+rmsprop")
    with pytest.raises(ConfigError, match="unknown strategy"):
        make_strategy("dpsdg")
    assert set(PRIVATIZERS) == {"fixed", "quantile", "oso", "zo", "none"} and "external" not in UPDATES
    # Found in review: the parts' class defaults (lr 0.1 without momentum, 1e-3) gave 0.06-0.48 on digits; a
    # composition takes the named strategies' horizon-aware defaults (fixed+sgd is dpsgd, fixed+adadp is adadp).
    assert make_strategy("fixed+sgd").update_rule == make_strategy("dpsgd").update_rule == SGD(lr=None, momentum=0.9)
    assert make_strategy("oso+adam").update_rule == Adam(lr=None)
    assert make_strategy("fixed+adadp").update_rule == make_strategy("adadp").update_rule
    assert make_strategy("quantile+adamwosm").update_rule.alpha is None
    assert make_strategy("fixed+sgd", lr=0.2, momentum=0.0).update_rule == SGD(lr=0.2, momentum=0.0)


def test_a_study_runs_a_composition_arm_end_to_end(tmp_path: Path) -> None:
    """The tuner builds on the same block: an arm named 'OSO+Adam' is validated, trained and
    accounted like any strategy, and a hyperparameter of neither part is one clear error."""
    from dptune.tune import StrategyArm, Study, TrainingSpec, run_study

    _, x, y = _problem(n=200)

    def study(arm: StrategyArm) -> Study:
        return make_study(
            (x[:150], y[:150], x[150:], y[150:]),
            arms=(arm,),
            training=TrainingSpec(steps=8, expected_batch_size=30),
            name="composed",
        )

    out = run_study(study(StrategyArm("OSO+Adam", space={"lr": [0.01, 0.1]})), tmp_path / "s", progress=False)
    assert out.complete and out.ledger_matches_plan and out.counts == {"done": 2}
    with pytest.raises(ConfigError, match="no hyperparameter 'momentum'"):
        run_study(
            study(StrategyArm("oso+adam", space={"momentum": [0.5]})),
            tmp_path / "bad",
            progress=False,
        )
    assert not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------- the boundary
def _calls_and_imports(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text())
    calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return calls, names


def test_only_privatizers_read_per_sample_gradients_or_release() -> None:
    step_code = [*sorted((SRC / "updates").glob("*.py")), SRC / "loop.py", *sorted((SRC / "strategies").glob("*.py"))]
    for path in step_code:
        calls, names = _calls_and_imports(path)
        assert not calls & {
            "grads",
            "weighted_sum",
            "release",
            "publish",
            "project",
            "materialize",
            "loss_and_grad",
            "losses",  # per-example losses (DP-ZO's finite differences)
        }, path
        assert not names & {"PerSampleGrads", "GradientOracle", "SumQuery", "NoisyRelease"} or path.name == "loop.py", (
            path
        )
    calls, names = _calls_and_imports(SRC / "updates" / "rules.py")
    assert "StepContext" not in names  # update rules never see the batch
    calls, _ = _calls_and_imports(SRC / "release" / "privatizers.py")
    assert {"grads", "publish"} <= calls  # StepContext.publish: the gateway's release, the per-example state freed


# ----------------------------------------------------------------------------- make_private
def _run_loop(private) -> None:
    for x, y in private.batches():
        private.step(x, y)


def _dpsgd_reference(x: torch.Tensor, y: torch.Tensor):
    """dptune.train's DP-Momentum run that the user-loop tests reproduce, and its settings."""
    kw = {"steps": 12, "expected_batch_size": 30, "noise_multiplier": 1.2, "seed": 7, "device": "cpu"}
    return dptune.train(_problem()[0], (x, y), "dpsgd", lr=0.3, clip=0.8, momentum=0.5, **kw), kw


def test_make_private_with_an_update_rule_is_train_bit_for_bit() -> None:
    model, x, y = _problem()
    ref, kw = _dpsgd_reference(x, y)
    private = dptune.make_private(model, (x, y), SGD(0.3, 0.5), privatizer=FixedClip(0.8), **kw)
    _run_loop(private)
    for k, p in model.named_parameters():
        assert torch.equal(p.detach(), ref.final_params[k]), k
    assert private.ledger.releases == ref.ledger.releases == 12
    assert private.epsilon(1e-5) == ref.epsilon(1e-5)


def test_make_private_with_a_torch_optimizer_is_the_same_algorithm() -> None:
    model, x, y = _problem()
    ref, kw = _dpsgd_reference(x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
    private = dptune.make_private(model, (x, y), opt, privatizer=FixedClip(0.8), **kw)
    for xb, yb in private.batches():
        opt.zero_grad()
        private.backward(xb, yb)
        opt.step()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref.final_params[k], rtol=1e-5, atol=1e-6)
    assert private.result().plan.strategy.config()["description"] == "torch.optim.sgd.SGD"


@pytest.mark.parametrize(("factor", "accept"), [(1.0, True), (0.9, False), (1.1, False)])
def test_released_grad_noise_has_std_nu_c_over_l(factor: float, accept: bool) -> None:
    """Zero per-example gradients: .grad is pure noise N(0, (νC/L)²) per coordinate. A KS test
    accepts the right σ and rejects σ off by 10% (the test can fail)."""
    grad, std = released_zero_grad_noise("cpu")
    p = stats.kstest(grad.flatten().double().numpy(), stats.norm(scale=factor * std).cdf).pvalue
    assert (p > 1e-3) if accept else (p < 1e-6)


def test_make_private_enforces_the_plan_and_the_batches() -> None:
    model, x, y = _problem()

    def fresh(steps: int = 3):
        return dptune.make_private(model, (x, y), SGD(0.1), steps=steps, expected_batch_size=30,
                                   noise_multiplier=1.0, seed=1, device="cpu")  # fmt: skip

    private = fresh()
    it = private.batches()
    xb, yb = next(it)
    b = len(yb)
    other = 1 + (torch.arange(b) % (len(y) - 1))  # a batch of the same size, of the user's choosing
    with pytest.raises(ConfigError, match="batches\\(\\) just yielded"):
        private.step(x[other], y[other] if not torch.equal(y[other], yb) else 1 - y[other])
    private.step(xb, yb)
    with pytest.raises(ConfigError, match="batches\\(\\) just yielded"):
        private.step(xb, yb)  # the same batch twice
    for xb, yb in it:
        private.step(xb, yb)
    assert private.t == private.steps == 3
    with pytest.raises(ConfigError, match="once, not once per epoch"):
        private.batches()  # a finished plan is an error, not an empty epoch (issue 23, 8b)
    with pytest.raises(BudgetExceededError, match="all were taken"):
        private.step(xb, yb)
    assert private.ledger.releases == 3

    # break, then resume: the unused batch comes back (no draw is wasted, nothing skipped)
    private = fresh()
    first = next(iter(private.batches()))
    again = next(iter(private.batches()))
    assert again[1] is first[1]
    private.step(*again)
    # skipping a batch (continue, list(...)) is refused where it happens
    with pytest.raises(ConfigError, match="was not passed to backward"):
        for _ in private.batches():
            continue
    with pytest.raises(ConfigError, match="was not passed to backward"):
        list(fresh().batches())

    with pytest.raises(ConfigError, match="not parameters of the model"):
        dptune.make_private(model, (x, y), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                            steps=3, expected_batch_size=30, noise_multiplier=1.0)  # fmt: skip
    with pytest.raises(ConfigError, match="optimizer must be"):
        dptune.make_private(model, (x, y), "adam", steps=3, expected_batch_size=30, noise_multiplier=1.0)


def test_an_exact_gradient_mixed_into_the_released_one_is_refused() -> None:
    """loss.backward() between private.backward() and optimizer.step() would add the exact,
    non-private gradient to .grad: refused where it lands (the parameters' post-accumulate hook), the
    released gradient put back, so the step is the private one; the pre-step hook refuses any other
    change of .grad (an in-place edit)."""
    model, x, y = _problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, steps=2, expected_batch_size=30,
                                  noise_multiplier=1.0, device="cpu")  # fmt: skip
    for xb, yb in private.batches():
        opt.zero_grad()
        private.backward(xb, yb)
        released = {k: p.grad.clone() for k, p in model.named_parameters()}
        with pytest.raises(ConfigError, match="backward pass reached a trainable parameter"):
            nn.functional.cross_entropy(model(xb), yb).backward()  # e.g. to log the loss: wrong
        # no .grad holds the exact gradient: the one it reached is dropped, the others are still the released
        assert all(p.grad is None or torch.equal(p.grad, released[k]) for k, p in model.named_parameters())
        next(p for p in model.parameters() if p.grad is not None).grad.add_(1.0)  # an in-place edit
        with pytest.raises(ConfigError, match="not the one private.backward\\(\\) released"):
            opt.step()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a habit of non-private loops: named, with the fix
        with pytest.raises(ConfigError, match="e.g. clip_grad_norm_.*Fix: drop clip_grad_norm_"):
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            loss = nn.functional.cross_entropy(model(xb), yb)  # the right way to look at the loss
        assert math.isfinite(float(loss))
        break


def test_frozen_layers_and_a_rejecting_adadp_in_your_loop() -> None:
    """Fine-tuning: frozen parameters in the optimizer are fine (they get no .grad). ADADP's
    rejected pair of half steps is undone in the user loop exactly as in dptune.train."""
    model, x, y = _problem()
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dptune.make_private(model, (x, y), opt, steps=2, expected_batch_size=30, noise_multiplier=1.0,
                                  device="cpu")  # fmt: skip
    for xb, yb in private.batches():
        opt.zero_grad()
        private.backward(xb, yb)
        opt.step()
    assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None

    kw = {
        "steps": 4,
        "expected_batch_size": 30,
        "noise_multiplier": 1.0,
        "seed": 2,
        "device": "cpu",
    }
    ref_model, mine = _problem()[0], _problem()[0]
    ref = dptune.train(ref_model, (x, y), "adadp", lr=0.5, tolerance=1e-9, **kw)
    assert ref.history[1]["accepted"] == 0.0  # the tiny tolerance rejects every pair
    private = dptune.make_private(mine, (x, y), ADADP(0.5, tolerance=1e-9), privatizer=FixedClip(1.0), **kw)
    rows = [private.step(xb, yb) for xb, yb in private.batches()]
    assert rows[1]["accepted"] == 0.0 and "adadp_error" in rows[1]  # the update's metrics are kept
    for k, p in mine.named_parameters():
        assert torch.equal(p.detach(), ref.final_params[k]), k


def test_make_private_stopped_early_spends_what_it_executed_and_saves_a_card(
    tmp_path: Path,
) -> None:
    model, x, y = _problem()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    private = dptune.make_private(
        model,
        (x, y),
        opt,
        privatizer=OSOClip(initial_clip=0.3),
        target_epsilon=2.0,
        delta=1e-5,
        epochs=2,
        expected_batch_size=30,
        seed=4,
        device="cpu",
    )
    for i, (xb, yb) in enumerate(private.batches()):
        opt.zero_grad()
        private.backward(xb, yb)
        opt.step()
        if i == 4:
            break  # early stop (e.g. on public validation data)
    assert private.ledger.releases == 5 < private.steps
    assert private.epsilon() < 2.0
    full = accounting.epsilon(private.plan.event(), 1e-5, private.plan.accountant)
    assert full <= 2.0 + 1e-9
    out = dptune.save_model(private.result(), tmp_path / "m")
    back, card = dptune.load_model(out, model=_problem()[0])
    for k, p in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], p)
    assert card["guarantee"]["epsilon"] == pytest.approx(private.epsilon())  # what was executed, not planned
    assert card["configuration"]["strategy"]["strategy"] == "oso+external"
    assert card["configuration"]["steps_taken"] == card["checkpoint"]["step"] == 5


def test_nonprivate_privatizer_has_infinite_epsilon() -> None:
    model, x, y = _problem()
    kw = {"steps": 2, "expected_batch_size": 30, "delta": 1e-5, "device": "cpu"}
    private = dptune.make_private(model, (x, y), SGD(0.1), privatizer=NonPrivate(), **kw)
    _run_loop(private)
    assert private.epsilon() == math.inf
    with pytest.raises(ConfigError, match="adds no noise"):  # a target it would silently ignore
        dptune.make_private(model, (x, y), SGD(0.1), privatizer=NonPrivate(), target_epsilon=1.0, **kw)


def test_composition_edges_names_clashes_and_pairings() -> None:
    assert make_strategy(" Online + Adam ").name == "oso+adam"
    assert make_strategy("nodp+momentum").name == "none+sgd"
    with pytest.raises(ConfigError, match="needs a private"):
        make_strategy("none+adamwosm")
    with pytest.raises(ConfigError, match="different values"):
        dptune.chain(OSOClip(rule="normalized"), OSORate(rule="exp"))  # config() would lose one


def test_adamwosm_step_size_uses_the_gradient_noise_of_the_privatizer() -> None:
    """ESS = α/(σ/L + 1e-8) with σ the std of g̃'s noise: ν·C for FixedClip, ν_g·C₀ for OSO."""
    model, x, y = _problem()
    nu, L = 1.3, 30.0
    r = dptune.train(model, (x, y), dptune.chain(OSOClip(initial_clip=0.4), AdamWOSM(1e-3)), steps=2,
                     expected_batch_size=L, noise_multiplier=nu, device="cpu")  # fmt: skip
    nu_g, _ = OSOClip().multipliers(r.plan)
    assert nu_g > nu
    assert r.history[0]["lr"] == pytest.approx(1e-3 / (nu_g * 0.4 / L + 1e-8), rel=1e-12)
    fixed = make_strategy("adamwosm", clip=0.4, alpha=1e-3)
    r = dptune.train(model, (x, y), fixed, steps=2, expected_batch_size=L, noise_multiplier=nu, device="cpu")
    assert r.history[0]["lr"] == pytest.approx(1e-3 / (nu * 0.4 / L + 1e-8), rel=1e-12)


def test_oso_additive_rule_needs_a_learning_rate() -> None:
    """The additive C rule scales by the update's learning rate: an update without one (NaN)
    is one clear error at the first C update, never a NaN sensitivity."""

    class NoRate(SGD):
        def rate(self, state):
            return float("nan")

    model, x, y = _problem()
    strategy = dptune.chain(OSOClip(rule="additive"), NoRate(0.1))
    with pytest.raises(ConfigError, match="additive C rule scales by the learning rate"):
        dptune.train(
            model,
            (x, y),
            strategy,
            steps=3,
            expected_batch_size=40,
            noise_multiplier=1.0,
            device="cpu",
        )
    r = dptune.train(model, (x, y), dptune.chain(OSOClip(rule="exp"), NoRate(0.1)), steps=3,
                     expected_batch_size=40, noise_multiplier=1.0, device="cpu")  # fmt: skip
    assert all(math.isfinite(row["clip"]) for row in r.history)


def test_hyperparameters_are_typed_by_the_strategy() -> None:
    """`--hp adapt_lr=maybe` or lr="0.1" is one clear error, not a string stored in the plan."""
    import numpy as np

    with pytest.raises(ConfigError, match="adapt_lr must be bool, got 'maybe'"):
        make_strategy("oso", adapt_lr="maybe")
    with pytest.raises(ConfigError, match="lr must be float or None, got '0.1'"):
        make_strategy("dpsgd", lr="0.1")
    with pytest.raises(ConfigError, match="clip must be float, got True"):
        make_strategy("dpsgd", clip=True)
    with pytest.raises(ConfigError, match="beta1 must be float"):
        make_strategy("oso+adam", beta1="x")
    # numbers of any kind (numpy from random search included), None where the field allows it
    assert make_strategy("dpsgd", lr=np.float64(0.5), clip=1).lr == 0.5
    assert make_strategy("oso", lr=None, q_noise_multiplier=None).lr is None
