"""The CUDA path end to end (skipped without a GPU; run on a GPU machine with ``pytest tests/gradients/test_cuda.py``).

* every registered strategy trains on the GPU with ghost norms and with vmap, keeps its weights
  there, and spends exactly its plan;
* ghost and vmap give the same run on the GPU (same seed, same batches, same noise);
* the released gradient's noise on the GPU has std νC/L, and not 0.9× or 1.1× that (KS);
* vectorised trials (``train_many``) on the GPU equal the sequential runs;
* CUDA graphs (``gradients.graphed``): a run replaying them equals the eager run, and the noise of a
  replayed step's release has std νC/L (KS, rejecting 0.9× and 1.1×);
* a study with ``training.device = "cuda"`` trains on the GPU with the process executor;
* the queued (pinned, non-blocking) copy of each batch's indices gives the same run as a blocking
  copy, also when batches are empty, and the divergence flag sees a bad entry on either device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import released_zero_grad_noise, small_cnn, stacked_cnn_noise
from scipy import stats
from torch import nn

import dptune
from dptune.strategies import STRATEGIES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _images(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 0.5).long()
    return x, y


@pytest.mark.parametrize("method", ["ghost", "vmap"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_trains_on_the_gpu_within_its_plan(name: str, method: str) -> None:
    x, y = _images()
    private = STRATEGIES[name]().private
    batch = {"full_batch": True} if name == "dpgd" else {"expected_batch_size": 24}
    res = dptune.train(
        _cnn(),
        (x, y),
        name,
        steps=6,
        **batch,
        device="cuda",
        seed=1,
        noise_multiplier=1.1 if private else None,
        eval_data=(x, y),
        eval_every=3,
        grad_method=method,
    )
    assert all(p.device.type == "cuda" for p in res.final_params.values())
    assert all(torch.isfinite(p).all() for p in res.final_params.values())
    assert res.ledger.matches(res.plan.event())


def test_ghost_and_vmap_are_the_same_run_on_the_gpu() -> None:
    x, y = _images()
    kw = {
        "steps": 8,
        "expected_batch_size": 24,
        "device": "cuda",
        "seed": 4,
        "noise_multiplier": 1.0,
        "lr": 0.2,
        "clip": 0.5,
    }
    a = dptune.train(_cnn(), (x, y), "dpsgd", grad_method="ghost", **kw)
    b = dptune.train(_cnn(), (x, y), "dpsgd", grad_method="vmap", **kw)
    for k in a.final_params:
        torch.testing.assert_close(a.final_params[k], b.final_params[k], rtol=1e-4, atol=1e-5)


def test_queued_index_copies_give_the_same_run_as_blocking_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's indices reach the GPU through pinned memory without a host wait
    (``inputs.indices_to``): the run (history, losses, parameters) equals the same seeded run
    with blocking copies, here at q so small that some Poisson batches are empty."""
    from dptune import inputs

    x, y = _images()
    kw = {"steps": 12, "device": "cuda", "seed": 5, "noise_multiplier": 1.0, "lr": 0.2, "clip": 0.5}
    for batch in (24.0, 0.5):  # 0.5 of 96: most batches are empty
        a = dptune.train(_cnn(), (x, y), "dpsgd", expected_batch_size=batch, **kw)
        with monkeypatch.context() as m:
            m.setattr(inputs, "indices_to", lambda idx, device: idx.to(device))
            b = dptune.train(_cnn(), (x, y), "dpsgd", expected_batch_size=batch, **kw)
        assert [r["batch_size"] for r in a.history] == [r["batch_size"] for r in b.history]
        assert [r.get("train_loss") for r in a.history] == [r.get("train_loss") for r in b.history]
        if batch < 1:
            assert 0 in [r["batch_size"] for r in a.history]
        for k in a.final_params:
            assert torch.equal(a.final_params[k], b.final_params[k])


def test_the_divergence_flag_sees_a_bad_entry_on_either_device() -> None:
    from dptune.tree import finite_flag, is_finite

    base = {"cpu": torch.zeros(3), "gpu": torch.zeros(4, device="cuda", dtype=torch.float16)}
    assert is_finite(base)
    for k in base:
        for bad in (float("nan"), float("inf")):
            a = {kk: vv.clone() for kk, vv in base.items()}
            a[k][1] = bad
            assert not bool(finite_flag(a)), (k, bad)


@pytest.mark.parametrize(("factor", "accept"), [(1.0, True), (0.9, False), (1.1, False)])
def test_released_grad_noise_on_the_gpu_has_std_nu_c_over_l(factor: float, accept: bool) -> None:
    grad, std = released_zero_grad_noise("cuda")
    assert grad.device.type == "cuda"
    p = stats.kstest(grad.flatten().double().cpu().numpy(), stats.norm(scale=factor * std).cdf).pvalue
    assert (p > 1e-3) if accept else (p < 1e-6)


def test_vectorised_trials_equal_sequential_runs_on_the_gpu() -> None:
    from dptune.vectorized import train_many

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 10, generator=g)
    y = (x[:, 0] > 0).long()

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 2))

    cfgs = [{"lr": 0.1, "clip": 0.5}, {"lr": 0.3, "clip": 1.0}, {"lr": 0.05, "clip": 2.0}]
    kw = {"steps": 7, "expected_batch_size": 32, "noise_multiplier": 1.0, "device": "cuda"}
    many = train_many(build, (x, y), "dpsgd", cfgs, [0, 1, 2], fallback="error", **kw)
    for k, (cfg, res) in enumerate(zip(cfgs, many, strict=True)):
        one = dptune.train(build(k), (x, y), "dpsgd", seed=k, **kw, **cfg)
        for name in one.final_params:
            torch.testing.assert_close(res.final_params[name], one.final_params[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", ["dpsgd", "nodp"])
def test_stacked_cnn_trials_equal_sequential_runs_on_the_gpu(strategy: str) -> None:
    """Conv2d/MaxPool2d/AvgPool2d trials stacked on the GPU (grouped convolution, patches + GEMM
    per-example gradients) give each trial's own ``dptune.train`` run: ledger, parameters. The
    non-private baseline too (its batch mean from the stacked gradients: the gpu-slice's NoDP arm)."""
    from dptune.vectorized import train_many

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 1, 10, 10, generator=g)
    y = (x[:, 0, :5].sum((1, 2)) > x[:, 0, 5:].sum((1, 2))).long()
    cfgs = [{"lr": 0.1, "clip": 0.5}, {"lr": 0.3, "clip": 1.0}, {"lr": 0.05, "clip": 2.0}]
    if strategy == "nodp":
        cfgs = [{"lr": c["lr"]} for c in cfgs]
    kw = {
        "steps": 6,
        "expected_batch_size": 32,
        "noise_multiplier": 1.0 if strategy == "dpsgd" else None,
        "device": "cuda",
    }
    many = train_many(small_cnn, (x, y), strategy, cfgs, [0, 1, 2], fallback="error", **kw)
    for k, (cfg, res) in enumerate(zip(cfgs, many, strict=True)):
        one = dptune.train(small_cnn(k), (x, y), strategy, seed=k, **kw, **cfg)
        assert res.ledger.to_dict() == one.ledger.to_dict()
        assert [r["batch_size"] for r in res.history] == [r["batch_size"] for r in one.history]
        for name in one.final_params:
            torch.testing.assert_close(res.final_params[name], one.final_params[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("factor", "accept"), [(1.0, True), (0.9, False), (1.1, False)])
def test_stacked_conv_noise_on_the_gpu_has_each_trials_own_std(factor: float, accept: bool) -> None:
    z, _ = stacked_cnn_noise("cuda")
    p = stats.kstest(z.numpy(), stats.norm(scale=factor).cdf).pvalue
    assert (p > 1e-3) if accept else (p < 1e-6)


def test_a_study_trains_on_the_gpu_with_the_process_executor(tmp_path: Path) -> None:
    from dptune.tune import run_study, study_from_dict

    study = study_from_dict(
        {
            "study": {"name": "cuda-study", "seeds": [0]},
            "data": {"name": "digits"},
            "model": {"name": "mlp"},
            "training": {"steps": 5, "expected_batch_size": 64, "device": "cuda"},
            "budget": {"epsilon": 4.0, "delta": 1e-5},
            "selection": {"mode": "public", "split": "test", "eval_every": 5},
            "strategies": [{"name": "dpsgd", "space": {"lr": [0.1, 0.5]}}, {"name": "oso", "space": {"lr": [0.1]}}],
        }
    )
    out = run_study(study, tmp_path / "s", executor="process", workers=2, progress=False)
    assert out.complete
    assert all(r["value_mean"] is not None for r in out.rows)


def test_ghost_norms_of_the_galli_cnn_hold_on_the_gpu_in_exact_float32() -> None:
    """cuDNN runs float32 convolutions in TF32 by default: the private computation must not
    (ghost and vmap would disagree and the norm bounds assume exact products). The ghost path
    stays on (no fall-back warning), its norms are never below vmap's, its sums match, and the
    user's TF32 settings are restored afterwards."""
    import warnings

    from dptune import models
    from dptune.gradients.oracle import GradientOracle

    torch.manual_seed(0)
    model = models.build("galli_cnn").cuda()
    params = {k: p.detach() for k, p in model.named_parameters()}
    x = torch.rand(64, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic)
    ghost = GradientOracle(model, "cross_entropy", method="ghost")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = ghost(params, x, y)
        got.norms  # noqa: B018 - computed lazily
    assert ghost.method == "ghost"
    ref = GradientOracle(model, "cross_entropy", method="vmap")(params, x, y)
    assert bool((got.norms >= ref.norms * (1 - 1e-6)).all())
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-4, atol=1e-7)
    w = torch.linspace(0.5, 1.5, 64, device="cuda")
    mine, theirs = got.weighted_sum(w), ref.weighted_sum(w)
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6)
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic) == before


def _asymmetric_convs() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, (2, 5), stride=(1, 3), padding=(2, 0), dilation=(3, 1)),
        nn.Tanh(),
        nn.Conv2d(4, 2, (3, 1), stride=(2, 1), padding=(0, 1), dilation=(1, 2)),
        nn.Flatten(),
        nn.Linear(2 * 4 * 7, 3),
    ).cuda()


def test_gemm_per_sample_convolutions_equal_vmap_on_the_gpu() -> None:
    """The CUDA path for kept convolutions (patches + batched GEMM, ``ghost.use_unfold_products``)
    on asymmetric kernels, strides, paddings and dilations, channels-last input: same norms and sums
    as vmap, norms never below."""
    import warnings

    from dptune.gradients.oracle import GradientOracle

    model = _asymmetric_convs()
    params = {k: p.detach() for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, 9, 17, generator=g).cuda().contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 3, (32,), generator=g).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = GradientOracle(model, "cross_entropy", method="ghost")(params, x, y)
        got.norms  # noqa: B018 - computed lazily
    ref = GradientOracle(model, "cross_entropy", method="vmap")(params, x, y)
    assert bool((got.norms >= ref.norms * (1 - 1e-6)).all())
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-4, atol=1e-7)
    w = torch.linspace(-1.0, 2.0, 32, device="cuda")
    mine, theirs = got.weighted_sum(w), ref.weighted_sum(w)
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6)


def test_recomputed_convolutions_release_at_most_their_norm_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Case (e) on CUDA (per-sample gradients too big to keep, recomputed for the release) with
    cuDNN's autotuner on: each example released alone has norm ≤ its N_i."""
    from dptune.gradients import ghost
    from dptune.gradients.oracle import GradientOracle

    monkeypatch.setattr(ghost, "MATERIALIZE_LIMIT_BYTES", 4096)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    model = _asymmetric_convs()
    params = {k: p.detach() for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 3, 9, 17, generator=g).cuda()
    y = torch.randint(0, 3, (16,), generator=g).cuda()
    got = GradientOracle(model, "cross_entropy", method="ghost")(params, x, y)
    norms = got.norms
    for i in range(16):
        w = torch.zeros(16, device="cuda")
        w[i] = 1.0
        released = got.weighted_sum(w)
        total = torch.sqrt(sum((v.double() ** 2).sum() for v in released.values()))
        assert float(total) <= float(norms[i]), i


def _count_replays(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of the CUDA graphs replayed (a list that grows as the run steps)."""
    from dptune.gradients import graphed

    replays: list[bool] = []
    real = graphed.Graphs.__call__

    def counting(self: graphed.Graphs, *a: object) -> object:
        got = real(self, *a)
        replays.append(got is not None)
        return got

    monkeypatch.setattr(graphed.Graphs, "__call__", counting)
    return replays


def test_a_run_replaying_cuda_graphs_equals_the_eager_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from dptune.gradients import graphed
    from dptune.gradients.oracle import GradientOracle

    replays = _count_replays(monkeypatch)
    monkeypatch.setattr(graphed, "MAX_PADDING", float("inf"))  # batches of 24: replayed all the same
    monkeypatch.setattr(GradientOracle, "_gap", lambda self: 10**6)  # the first probe only (later: random calls)
    x, y = _images(160)
    kw = {"steps": 10, "expected_batch_size": 24, "device": "cuda", "seed": 4, "noise_multiplier": 1.0}
    for name, hp in (("dpsgd", {"clip": 0.5}), ("oso", {"initial_clip": 0.5}), ("dpadam", {"clip": 0.5})):
        kw.update(hp)
        replays.clear()
        a = dptune.train(_cnn(), (x, y), name, **kw)
        assert sum(replays) >= 8, replays  # the first step is probed (eager); the others replay
        with monkeypatch.context() as m:
            m.setattr(graphed, "ENABLED", False)
            b = dptune.train(_cnn(), (x, y), name, **kw)
        kw.pop(next(iter(hp)))
        assert a.ledger.matches(a.plan.event()) and [r["batch_size"] for r in a.history] == [
            r["batch_size"] for r in b.history
        ]
        for k in a.final_params:
            torch.testing.assert_close(a.final_params[k], b.final_params[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("factor", "accept"), [(1.0, True), (0.9, False), (1.1, False)])
def test_a_replayed_steps_noise_has_std_nu_c_over_l(
    factor: float, accept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dptune.gradients import graphed

    monkeypatch.setattr(graphed, "MAX_PADDING", float("inf"))  # L = 16: replayed all the same
    grad, std = released_zero_grad_noise("cuda", steps=3)  # steps 2 and 3 replay the graphs
    p = stats.kstest(grad.flatten().double().cpu().numpy(), stats.norm(scale=factor * std).cdf).pvalue
    assert (p > 1e-3) if accept else (p < 1e-6)


class _YourCNN(nn.Sequential):
    """The test CNN as a class of yours (own code, not declared row-wise): ghost rules under vmap."""


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no fallback to vmap: the row-wise ghost path itself
def test_your_forward_on_the_gpu_takes_the_rowwise_ghost_path_and_equals_vmap() -> None:
    from dptune.gradients.oracle import GradientOracle

    def yours(seed: int) -> nn.Module:
        model = _cnn(seed)
        model.__class__ = _YourCNN
        return model

    oracle = GradientOracle(yours(0).cuda(), nn.CrossEntropyLoss(reduction="none"))
    assert oracle.method == "ghost" and oracle._ghost.rowwise
    x, y = _images()
    kw = {"steps": 8, "expected_batch_size": 24, "device": "cuda", "seed": 4, "noise_multiplier": 1.0, "clip": 0.5}
    a = dptune.train(yours(0), (x, y), "dpsgd", **kw)
    b = dptune.train(yours(0), (x, y), "dpsgd", grad_method="vmap", **kw)
    assert a.ledger.matches(a.plan.event())
    for k in a.final_params:
        torch.testing.assert_close(a.final_params[k], b.final_params[k], rtol=1e-4, atol=1e-5)


def test_a_hugging_face_encoder_replays_cuda_graphs_and_equals_the_eager_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stock BERT (tiny config, no dropout): the capture is not refused (no host read in the ghost
    step), later steps replay, and the run equals the eager one."""
    pytest.importorskip("transformers")
    from hf_models import tiny_classifier, token_batch

    from dptune.gradients import graphed

    replays = _count_replays(monkeypatch)
    monkeypatch.setattr(graphed, "MAX_PADDING", float("inf"))
    x, y = token_batch(96, 16, seed=4)
    kw = {"steps": 8, "expected_batch_size": 16, "device": "cuda", "seed": 3, "noise_multiplier": 1.0, "lr": 1e-2}
    a = dptune.train(tiny_classifier("bert", dropout=0.0), (x, y), "dpadam", grad_method="ghost", **kw)
    assert sum(replays) >= 6, replays
    monkeypatch.setattr(graphed, "ENABLED", False)
    b = dptune.train(tiny_classifier("bert", dropout=0.0), (x, y), "dpadam", grad_method="ghost", **kw)
    assert a.ledger.matches(a.plan.event())
    for k in a.final_params:
        torch.testing.assert_close(a.final_params[k], b.final_params[k], rtol=1e-4, atol=1e-5)


def test_the_cosine_diagnostic_runs_on_the_gpu_as_on_the_cpu() -> None:
    """Galli's Fig. 1 diagnostic (``report.cosine_vs_clip``) with the model and data on the GPU: its weights
    and batch masks on the data's device, and the same curve as on the CPU (same seed, same batches; ν = 0: the
    GPU draws its own normals)."""
    from dptune.report import cosine_vs_clip

    x, y = _images()
    got = {}
    for dev in ("cpu", "cuda"):
        model = _cnn().to(dev)
        params = {k: v.detach() for k, v in model.named_parameters()}
        got[dev] = cosine_vs_clip(model, (x.to(dev), y.to(dev)), {0: params}, [0.1, 1.0], 0.0, 24.0, repeats=3, seed=2)
    assert got["cuda"].mean[0] == pytest.approx(got["cpu"].mean[0], abs=1e-4)
