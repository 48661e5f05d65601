"""dptune.metrics (issue 14, item 3): one Metric type, its resolver and direction table, the
clamp of a private release, and the one batched evaluation that train, the vectorised trials and
the tuner's scorer share."""

from __future__ import annotations

import math

import pytest
import torch

import dptune
from dptune import metrics, own
from dptune.errors import ConfigError
from dptune.gradients.oracle import GradientOracle
from dptune.metrics import ACCURACY, BUILTINS, HIGHER_IS_BETTER, MSE, Metric
from dptune.train import evaluate


# ----------------------------------------------------------------------------- resolver
def test_resolver_names_and_default() -> None:
    assert metrics.resolve("accuracy") is ACCURACY
    assert metrics.resolve("mse") is MSE
    assert metrics.resolve(None, "mse") is MSE  # None: the task's default
    m = Metric(lambda o, t: o[:, 0], name="mine")
    assert metrics.resolve(m) is m


def test_resolver_factory_path_names_a_metric() -> None:
    import own_factories  # tests/ is on sys.path (conftest)

    assert metrics.resolve("own_factories:ACCURACY") is own_factories.ACCURACY
    assert metrics.higher_is_better("own_factories:ACCURACY") is True
    with pytest.raises(ConfigError, match=r"not a dptune\.Metric\. Fix:"):
        metrics.resolve("own_factories:make_model")
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_module_x'.*Fix:"):
        metrics.resolve("no_such_module_x:M")


def test_resolver_bare_callable_is_a_metric_without_sensitivity() -> None:
    def hits(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out.argmax(1) == y).double()

    m = metrics.resolve(hits)
    assert isinstance(m, Metric) and m.fn is hits
    assert (m.name, m.higher_is_better, m.sensitivity) == ("hits", True, None)
    with pytest.raises(ConfigError, match="states no sensitivity.*Fix:"):
        m.require_sensitivity()


@pytest.mark.parametrize("bad", ["accuracyy", "loss", "", 3, 2.5, ["accuracy"]])
def test_resolver_refuses_bad_input_with_a_fix(bad: object) -> None:
    # "loss" has a direction (reports) but no evaluation: refused before any training.
    with pytest.raises(ConfigError) as err:
        metrics.resolve(bad)
    assert "Fix:" in str(err.value)
    assert "accuracy" in str(err.value) and "mse" in str(err.value)


def test_train_refuses_an_unknown_metric_before_training() -> None:
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    with pytest.raises(ConfigError, match="unknown metric 'loss'.*Fix:"):
        dptune.train(torch.nn.Linear(3, 2), (x, y), "dpsgd", steps=1, expected_batch_size=5, noise_multiplier=1.0,
                     eval_data=(x, y), metric="loss")  # fmt: skip


# ----------------------------------------------------------------------------- direction table
def test_one_direction_table() -> None:
    from dptune.report import data as report_data

    for name, m in BUILTINS.items():
        assert m.name == name
        assert HIGHER_IS_BETTER[name] is m.higher_is_better
        assert metrics.higher_is_better(name) is m.higher_is_better
    assert set(BUILTINS) < set(HIGHER_IS_BETTER) and HIGHER_IS_BETTER["loss"] is False
    # Everyone reads the same table and the same class.
    assert report_data.HIGHER_IS_BETTER is HIGHER_IS_BETTER
    assert report_data.higher_is_better("mse") is False and report_data.higher_is_better("mse", True) is True
    assert dptune.Metric is Metric
    # The old homes are gone: one Metric, one direction table.
    assert not hasattr(own, "Metric") and not hasattr(own, "HIGHER_IS_BETTER") and not hasattr(own, "metric_higher")
    with pytest.raises(ConfigError, match="unknown metric 'f1'.*Fix:"):
        metrics.higher_is_better("f1")
    for reserved in HIGHER_IS_BETTER:  # a user metric cannot take a built-in's name (or direction)
        with pytest.raises(ConfigError, match="reserved.*Fix:"):
            Metric(lambda o, t: o, name=reserved)


# ----------------------------------------------------------------------------- clipping
def test_clip_counts_a_non_finite_score_as_the_worst_one() -> None:
    raw = torch.tensor([0.5, math.nan, math.inf, -math.inf, 3.0, -1.0])
    out = torch.zeros(6, 1)
    up = Metric(lambda o, t: raw.clone(), higher_is_better=True, sensitivity=2.0)
    down = Metric(lambda o, t: raw.clone(), higher_is_better=False, sensitivity=2.0)
    assert up.scores(out, out, clip=True).tolist() == [0.5, 0.0, 0.0, 0.0, 2.0, 0.0]
    assert down.scores(out, out, clip=True).tolist() == [0.5, 2.0, 2.0, 2.0, 2.0, 0.0]
    unclipped = up.scores(out, out)
    assert unclipped.dtype == torch.float64 and math.isnan(unclipped[1]) and unclipped[4] == 3.0


def test_builtin_mse_clip_and_accuracy_on_non_finite_predictions() -> None:
    out = torch.tensor([[0.0, 0.0], [math.nan, 0.0], [math.inf, 1.0], [10.0, 0.0]])
    y = torch.zeros(4, 2)
    with pytest.raises(ConfigError, match="states no sensitivity"):
        MSE.scores(out, y, clip=True)  # its clip is the study's mse_clip
    mse = MSE.with_sensitivity(0.5)
    assert mse.name == "mse" and MSE.sensitivity is None
    assert mse.scores(out, y, clip=True).tolist() == [0.0, 0.5, 0.5, 0.5]
    assert mse.scores(out, y).dtype == torch.float32  # summed as dptune always did: same runs
    # A NaN row's argmax is its NaN's index (0 here, the label): still a wrong prediction.
    logits = torch.tensor([[math.nan, 0.0], [2.0, 1.0], [0.0, 1.0]])
    assert ACCURACY.scores(logits, torch.tensor([0, 0, 0])).tolist() == [0, 1, 0]
    assert ACCURACY.scores(logits, torch.tensor([0, 0, 0]), clip=True).tolist() == [0.0, 1.0, 0.0]


def test_a_metric_must_score_each_example() -> None:
    mean = Metric(lambda o, t: (o.argmax(1) == t).double().mean(), name="mean")
    with pytest.raises(ConfigError, match=r"one score per example \(shape \[3\]\), got \(\)\. Fix:"):
        mean.scores(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))


# ----------------------------------------------------------------------------- one batched evaluation
N, BATCH = 53, 8  # 7 batches, the last one short


def _data(classes: int, seed: int = 1) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, classes)).double()
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (N,), generator=g) if classes > 1 else torch.randn(N, 1, generator=g).double()
    return model, x, y


def _reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, name: str) -> float:
    """The metric by hand, one example at a time, no batching."""
    total = 0.0
    with torch.no_grad():
        for i in range(N):
            out = model(x[i])
            if name == "accuracy":
                total += float(int(out.argmax()) == int(y[i]))
            elif name == "mse":
                total += float(((out - y[i]) ** 2).mean())
            else:  # the user metric below: the probability of the true class
                total += float(torch.softmax(out, 0)[y[i]])
    return total / N


def _prob(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.softmax(out, 1).gather(1, y[:, None])[:, 0]


@pytest.mark.parametrize("name", ["accuracy", "mse", "prob"])
def test_batched_evaluation_equals_the_unbatched_reference(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, y = _data(1 if name == "mse" else 3)
    metric = Metric(_prob, name="prob") if name == "prob" else name
    monkeypatch.setattr(metrics, "EVAL_BATCH", BATCH)
    rows: list[int] = []

    def forward(xb: torch.Tensor) -> torch.Tensor:
        rows.append(int(xb.shape[0]))
        return model(xb)

    (value,) = metrics.mean_scores(forward, (x, y), metrics.resolve(metric))
    assert rows == [BATCH] * (N // BATCH) + [N % BATCH]  # EVAL_BATCH is honoured: 7 batches
    ref = _reference(model, x, y, name)
    assert value == ref if name == "accuracy" else value == pytest.approx(ref, rel=1e-12, abs=1e-15)
    # dptune.train.evaluate and a map-style dataset read chunk by chunk give the same number.
    oracle = GradientOracle(model, "mse" if name == "mse" else "cross_entropy")
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert evaluate(oracle, params, x, y, metric) == value
    chunks = own.MapSource(torch.utils.data.StackDataset(x, y), torch.device("cpu")).chunks()
    assert metrics.mean_scores(forward, chunks, metrics.resolve(metric)) == [value]


@pytest.mark.parametrize("name", ["accuracy", "mse"])
def test_stacked_evaluation_scores_each_parameter_set(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``trials=K`` (the vectorised trials' stacked forward): K sums, each that of its own set."""
    monkeypatch.setattr(metrics, "EVAL_BATCH", BATCH)
    models = [_data(1 if name == "mse" else 3, seed)[0] for seed in (1, 3, 4)]  # three sets, three scores
    _, x, y = _data(1 if name == "mse" else 3)

    def stacked(xb: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(xb) for m in models])

    values = metrics.mean_scores(stacked, (x, y), BUILTINS[name], trials=3)
    refs = [_reference(m, x, y, name) for m in models]
    assert len(set(refs)) == 3
    assert values == refs if name == "accuracy" else values == pytest.approx(refs, rel=1e-12)


def test_score_sums_clip_and_empty_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "EVAL_BATCH", BATCH)
    model, x, y = _data(1)
    x[5, 0] = math.nan  # a NaN prediction: its error counts as the clip c
    c = 0.5
    with torch.no_grad():
        errs = [float(((model(x[i]) - y[i]) ** 2).mean()) for i in range(N)]
    ref = sum(c if math.isnan(e) else min(e, c) for e in errs)
    assert 0 < sum(e > c for e in errs if not math.isnan(e)) < N - 1  # some errors are clamped, some not
    sums, n = metrics.score_sums(model, (x, y), MSE.with_sensitivity(c), clip=True)
    assert n == N and sums == [pytest.approx(ref, rel=1e-12)]
    assert math.isnan(metrics.score_sums(model, (x, y), MSE)[0][0])  # unclipped: the exact (NaN) sum
    assert math.isnan(metrics.mean_scores(model, (x[:0], y[:0]), MSE)[0])  # no data: NaN, not 0


def test_train_many_takes_a_metric_like_train() -> None:
    """The vectorised trials evaluate your own Metric (stacked forward) as ``train`` does."""
    from dptune.vectorized import train_many, trial_seeds

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)
    hits = Metric(lambda o, t: (o.argmax(1) == t).double(), name="hits")

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed % 1000)
        return torch.nn.Sequential(torch.nn.Linear(5, 3))

    run = dict(steps=4, expected_batch_size=20, noise_multiplier=1.0, eval_data=(x, y), eval_every=2, metric=hits)
    stacked = train_many(model, (x, y), "dpsgd", configs=[{"clip": 1.0}, {"clip": 2.0}], fallback="error", **run)
    seed = trial_seeds(0, 2)[0]
    alone = dptune.train(model(seed), (x, y), "dpsgd", clip=1.0, seed=seed, **run)
    assert stacked[0].metric == "hits" and [e["step"] for e in stacked[0].evals] == [2, 4]
    assert stacked[0].evals == alone.evals


def test_evaluation_switches_dropout_off_and_restores_every_modules_mode() -> None:
    """A score is of the parameters, not of one dropout draw: evaluation runs in eval mode (two
    evaluations agree, and equal the eval-mode forward), and each module gets its own mode back
    (one the user froze in eval mode stays so)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Dropout(0.9), torch.nn.Linear(32, 3))
    model[2].eval()
    x, y = torch.randn(300, 5), torch.randint(0, 3, (300,))
    oracle = GradientOracle(model, "cross_entropy")
    params = dict(model.named_parameters())
    first, second = evaluate(oracle, params, x, y, "accuracy"), evaluate(oracle, params, x, y, "accuracy")
    model.eval()
    with torch.no_grad():
        expected = (model(x).argmax(1) == y).double().mean().item()
    model.train()
    model[2].eval()
    assert first == second == pytest.approx(expected, abs=1e-12)
    assert [m.training for m in model.modules()] == [True, True, True, False]
    oracle_modes = []
    with metrics.eval_mode(model):
        oracle_modes = [m.training for m in model.modules()]
    assert oracle_modes == [False] * 4 and [m.training for m in model.modules()] == [True, True, True, False]


# ----------------------------------------------------------------------------- audit: private sums, accuracy shapes
class _Square(torch.nn.Module):
    """out = x: the squared error against y = 0 is x², an example's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


def test_private_mse_sum_of_neighbours_moves_by_at_most_c() -> None:
    """The audit's neighbours: 4,095 errors uniform in [0, 1) and one of exactly c = 1. Summed in float32 the
    released sums differed by up to 1.00024·c; in float64 by c(1 ± 1e-12)."""
    model, mse = _Square(), MSE.with_sensitivity(1.0)
    assert mse.scores(torch.ones(3, 1), torch.zeros(3, 1), clip=True).dtype == torch.float64
    worst = 0.0
    for seed in range(14):  # seed 12 moved the old float32 sum by 1.00024 (one thread)
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(4095, generator=g).sqrt().unsqueeze(1)
        at = int(torch.randint(0, 4095, (1,), generator=g))
        x2 = torch.cat([x[:at], torch.ones(1, 1), x[at:]])
        (a,), _ = metrics.score_sums(model, (x, torch.zeros(4095, 1)), mse, clip=True)
        (b,), _ = metrics.score_sums(model, (x2, torch.zeros(4096, 1)), mse, clip=True)
        worst = max(worst, abs(b - a))
    assert 1.0 - 1e-6 <= worst <= 1.0 + 1e-6


def _token_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position logits [B, C, T] against labels [B, T], some labels -100 (ignored), one row NaN."""
    g = torch.Generator().manual_seed(0)
    out, y = torch.randn(9, 4, 6, generator=g), torch.randint(0, 4, (9, 6), generator=g)
    y[::2, :3] = y[::2, :3].where(torch.rand(5, 3, generator=g) < 0.5, -100)
    y[3] = -100  # no labelled position: 0
    out[5, 0, 0] = math.nan  # any non-finite output: all wrong
    hit = (out.argmax(1) == y).double()
    ref = [float(hit[i][y[i] != -100].mean()) if (y[i] != -100).any() else 0.0 for i in range(9)]
    ref[5] = 0.0
    return out, y, torch.tensor(ref, dtype=torch.float64)


def _one_logit_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A single logit [B, 1] against float BCE targets [B, 1]: broadcast to [B, B] by the old code."""
    g = torch.Generator().manual_seed(1)
    out, y = torch.randn(7, 1, generator=g), (torch.rand(7, 1, generator=g) < 0.5).float()
    return out, y, ((out > 0).float() == y).double().reshape(7)


class _Table(torch.nn.Module):
    """Row i of a fixed output table for input i (so the private path can score each example alone)."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out = out

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.out[i.reshape(-1).long()]


@pytest.mark.parametrize("case", [_token_case, _one_logit_case])
def test_accuracy_is_each_examples_fraction_right_on_every_path(case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Old code: [B, 1] against [B, 1] scored each example against the whole batch (accuracy 100.25), and
    [B, C, T] counted correct positions (6 a row). Now a fraction in [0, 1], the same public, private and stacked."""
    out, y, ref = case()
    b = int(y.shape[0])
    idx, table = torch.arange(b).unsqueeze(1), _Table(out)
    assert torch.equal(ACCURACY.scores(out, y), ref) and torch.equal(ACCURACY.scores(out, y, clip=True), ref)
    monkeypatch.setattr(metrics, "EVAL_BATCH", 4)  # several batches
    (public,) = metrics.mean_scores(table, (idx, y), ACCURACY)
    assert 0.0 <= public <= 1.0 and public == pytest.approx(float(ref.mean()), abs=1e-12)
    (private,), n = metrics.score_sums(table, (idx, y), ACCURACY, clip=True)
    assert n == b and private == pytest.approx(float(ref.sum()), abs=1e-12)
    isolated = metrics._isolated_scores(table, idx, y, ACCURACY, table)  # each example's score from its row alone
    assert torch.equal(isolated, ref)
    stacked = metrics.mean_scores(lambda i: torch.stack([table(i), table(i)]), (idx, y), ACCURACY, trials=2)
    assert stacked == [pytest.approx(public, abs=1e-12)] * 2


def test_accuracy_refuses_outputs_that_do_not_match_the_labels() -> None:
    """[B, T, C] logits (classes last) against [B, T] labels: argmax over dim 1 would pick positions."""
    with pytest.raises(ConfigError, match=r"one prediction per label.*Fix: classes on dim 1"):
        ACCURACY.scores(torch.randn(4, 6, 3), torch.zeros(4, 6, dtype=torch.long))


def test_train_reports_single_logit_bce_accuracy_as_a_fraction() -> None:
    """The audit's run: ``nn.Linear(5, 1)``, BCE, [n, 1] targets; old code reported 100.25."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 5, generator=g)
    y = (x[:, :1] > 0).float()
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    r = dptune.train(
        model, (x[:200], y[:200]), "dpsgd", loss="bce", steps=6, expected_batch_size=50, noise_multiplier=1.0,
        eval_data=(x[200:], y[200:]), eval_public=True, eval_every=3, seed=0, momentum=0.0,
    )  # fmt: skip
    assert r.evals[-1]["step"] == r.plan.steps
    with torch.no_grad():
        out = torch.func.functional_call(model, r.final_params, (x[200:],))
    assert r.evals[-1]["accuracy"] == pytest.approx(float(((out > 0).float() == y[200:]).double().mean()), abs=1e-12)
