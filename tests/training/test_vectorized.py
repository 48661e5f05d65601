"""``dptune.vectorized.train_many`` equals K sequential ``dptune.train`` runs (same seeds)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import params_of, small_cnn, stacked_cnn_noise
from scipy import stats
from torch import nn
from torch.nn import functional as F

from dptune.errors import ConfigError
from dptune.gradients import stacked as stacked_module
from dptune.gradients.persample import batched_loss
from dptune.gradients.stacked import PaddedBuffers, Stacked, stack_plan
from dptune.train import train
from dptune.vectorized import train_many

pytestmark = pytest.mark.usefixtures("one_thread")


G = torch.Generator().manual_seed(0)
X = torch.randn(300, 10, generator=G)
Y = (X[:, 0] - X[:, 1] + 0.3 * torch.randn(300, generator=G) > 0).long()
XE = torch.randn(200, 10, generator=G)
YE = (XE[:, 0] - XE[:, 1] > 0).long()
XI = torch.randn(300, 1, 10, 10, generator=G)  # images for the stacked CNN
YI = (XI[:, 0, :5].sum((1, 2)) > XI[:, 0, 5:].sum((1, 2))).long()


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(10, 12), nn.LeakyReLU(), nn.Sequential(nn.Linear(12, 8), nn.Tanh()), nn.Linear(8, 2)
    )


GRIDS = {
    "dpsgd": [{"lr": 0.2, "clip": 0.05}, {"lr": 0.5, "clip": 1.0, "momentum": 0.5}, {"lr": 0.1, "clip": 10.0}],
    "nodp": [{"lr": 0.05}, {"lr": 0.5, "momentum": 0.9}, {"lr": 1.0}],
    "adamwosm": [{"clip": 0.05}, {"clip": 1.0}, {"clip": 5.0}],
    "oso": [
        {"lr": 0.2, "initial_clip": 0.05},
        {"lr": 0.5, "initial_clip": 1.0, "clip_lr": 0.1, "lr_lr": 0.1},
        {"lr": 0.1, "initial_clip": 5.0, "rule": "normalized", "clip_lr": 0.2},
    ],
    "quantile": [
        {"lr": 0.2, "target_quantile": 0.2},
        {"lr": 0.5, "target_quantile": 0.5},
        {"lr": 0.3, "target_quantile": 0.9},
    ],
    "dpadam": [{"lr": 0.01}, {"lr": 0.05, "clip": 0.2}, {"lr": 0.001}],
}


def rounded(o, digits: int):
    """``o`` with every float rounded to ``digits`` significant digits (nested dicts and lists)."""
    if isinstance(o, float):
        return float(f"{o:.{digits}g}")
    if isinstance(o, dict):
        return {k: rounded(v, digits) for k, v in o.items()}
    return [rounded(v, digits) for v in o] if isinstance(o, list) else o


def assert_same_run(got, ref, atol: float = 1e-6, ledger_digits: int = 17) -> None:
    """``ledger_digits``: adaptive clips (OSO) are recorded in the ledger, equal up to float rounding."""
    assert rounded(got.ledger.to_dict(), ledger_digits) == rounded(ref.ledger.to_dict(), ledger_digits)
    assert got.plan == ref.plan and got.diverged == ref.diverged
    for k in ref.final_params:
        torch.testing.assert_close(got.final_params[k], ref.final_params[k], rtol=1e-5, atol=atol, msg=k)
    assert len(got.history) == len(ref.history)
    for a, b in zip(got.history, ref.history, strict=True):
        assert set(a) == set(b)
        assert a["batch_size"] == b["batch_size"]  # the same Poisson batches
        for key in a:
            if isinstance(b[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert [e["step"] for e in got.evals] == [e["step"] for e in ref.evals]
    for a, b in zip(got.evals, ref.evals, strict=True):
        assert a[got.metric] == pytest.approx(b[ref.metric], abs=1.5 / XE.shape[0])
    assert got.best_step == ref.best_step


@pytest.mark.parametrize("strategy", sorted(GRIDS))
def test_train_many_equals_sequential_train(strategy: str) -> None:
    cfgs = GRIDS[strategy]
    seeds = [11, 12, 13]
    nu = None if strategy == "nodp" else 0.8
    kw = dict(steps=12, expected_batch_size=40, eval_data=(XE, YE), eval_every=5)
    got = train_many(mlp, (X, Y), strategy, cfgs, seeds, noise_multiplier=nu, fallback="error", **kw)
    for k, (cfg, seed) in enumerate(zip(cfgs, seeds, strict=True)):
        ref = train(mlp(seed), (X, Y), strategy, seed=seed, noise_multiplier=nu, **kw, **cfg)
        assert_same_run(got[k], ref)
    # The trials really differ (own hyperparameters, own noise and batches).
    assert not torch.allclose(got[0].final_params["1.weight"], got[1].final_params["1.weight"])


@pytest.mark.parametrize(("strategy", "gemm"), [("dpsgd", False), ("oso", False), ("dpsgd", True), ("oso", True)])
def test_stacked_cnn_trials_equal_sequential_train(strategy: str, gemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conv2d, MaxPool2d, AvgPool2d stacked: the same batches, ledgers, releases and evaluations; with
    CUDA's kernels forced too (the convolutions as batched products over patches, ``conv_by_patches``)."""
    monkeypatch.setattr(stacked_module, "gemm_patches", lambda device: gemm)
    cfgs, seeds = GRIDS[strategy], [11, 12, 13]
    kw = dict(steps=6, expected_batch_size=30, eval_data=(XI[:200], YI[:200]), eval_every=3)
    got = train_many(small_cnn, (XI, YI), strategy, cfgs, seeds, noise_multiplier=0.8, fallback="error", **kw)
    for k, (cfg, seed) in enumerate(zip(cfgs, seeds, strict=True)):
        ref = train(small_cnn(seed), (XI, YI), strategy, seed=seed, noise_multiplier=0.8, **kw, **cfg)
        assert_same_run(got[k], ref, ledger_digits=8)
    assert not torch.allclose(got[0].final_params["0.weight"], got[1].final_params["0.weight"])


@pytest.mark.parametrize("gemm", [False, True])
def test_stacked_conv_grads_are_each_rows_own(gemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per trial and row, the stacked norm bounds that example's own gradient (vmap at the trial's
    parameters) tightly and the weighted sum is Σ w_i g_i: no row or trial reads another's. Both
    kernels: the grouped backward (CPU) and patches + batched GEMM (CUDA's, forced here)."""
    monkeypatch.setattr(stacked_module, "gemm_patches", lambda device: gemm)
    models = [small_cnn(s) for s in (1, 2, 3)]
    params = [params_of(m) for m in models]
    idxs = [torch.tensor([3, 7, 20, 21]), torch.tensor([], dtype=torch.long), torch.arange(40, 50)]
    lossfn = batched_loss("cross_entropy")
    views = Stacked(stack_plan(models[0])).grads(params, idxs, lossfn, XI, YI, PaddedBuffers())
    for model, p, idx, (xk, g) in zip(models, params, idxs, views, strict=True):
        assert torch.equal(xk, XI[idx])
        if not len(idx):
            assert g.norms.shape == (0,) and not g.weighted_sum(torch.zeros(0))["0.weight"].any()
            continue

        def loss(q, x, y, model=model):
            return lossfn(torch.func.functional_call(model, q, (x[None],)), y[None])[0]

        ref = torch.func.vmap(torch.func.grad(loss), (None, 0, 0))(p, XI[idx], YI[idx])
        true = torch.cat([r.flatten(1) for r in ref.values()], 1).norm(dim=1)
        assert (g.norms >= true).all() and torch.allclose(g.norms, true, rtol=1e-4, atol=1e-6)
        w = torch.linspace(-1.0, 2.0, len(idx))
        got = g.weighted_sum(w)
        for name, r in ref.items():
            torch.testing.assert_close(got[name], torch.einsum("i,i...->...", w, r), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("gemm", [False, True])
def test_stacked_clipped_sums_are_each_trials_own(gemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``presum_clipped``: each trial's Σ_i min(1, C_k/N_i) g_i formed for all trials at once (batched products
    forced here, as on CUDA) equals that trial's own clipped sum over its own rows; another C is not served."""
    from dptune.release.privatizers import clip_weights

    monkeypatch.setattr(stacked_module, "gemm_patches", lambda device: gemm)
    models = [small_cnn(s) for s in (1, 2, 3)]
    params = [params_of(m) for m in models]
    idxs = [torch.tensor([3, 7, 20, 21]), torch.arange(60, 90), torch.arange(40, 50)]  # padded to 30 rows
    clips = [0.05, 1.0, 20.0]
    lossfn = batched_loss("cross_entropy")
    views = Stacked(stack_plan(models[0])).grads(params, idxs, lossfn, XI, YI, PaddedBuffers(), clips)
    for (_, g), c in zip(views, clips, strict=True):
        served = g.clipped(c)
        assert served is not None and g.clipped(c * (1 + 1e-9)) is None
        g._pre = None  # the trial alone, as without stacking (not from the served sum: ``reset_reuse``)
        g.reset_reuse()
        alone = g.weighted_sum(clip_weights(g.norms, c))
        for name, v in alone.items():
            torch.testing.assert_close(served.wide[name], alone.wide[name], rtol=1e-12, atol=1e-15, msg=name)
            assert served[name].dtype == v.dtype


def test_train_many_serves_the_stacked_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """DP-SGD, quantile and OSO trials take their clipped sums from the stacked engine (one product a layer for
    all trials), every step."""
    from dptune.gradients.ghost_layers import LayerGrads

    hits: list[float] = []
    clipped = LayerGrads.clipped

    def counted(self: LayerGrads, clip: float):  # type: ignore[no-untyped-def]
        got = clipped(self, clip)
        hits.append(got is not None)
        return got

    monkeypatch.setattr(LayerGrads, "clipped", counted)
    for strategy in ("dpsgd", "quantile", "oso"):
        hits.clear()
        train_many(small_cnn, (XI, YI), strategy, GRIDS[strategy], [1, 2, 3], noise_multiplier=0.8, steps=4,
                   expected_batch_size=30, fallback="error")  # fmt: skip
        assert len(hits) == 3 * 4 and all(hits), strategy


@pytest.mark.parametrize(("factor", "accept"), [(1.0, True), (0.9, False), (1.1, False)])
def test_stacked_conv_noise_has_each_trials_own_std(factor: float, accept: bool) -> None:
    z, moves = stacked_cnn_noise("cpu")
    p = stats.kstest(z.numpy(), stats.norm(scale=factor).cdf).pvalue
    assert (p > 1e-3) if accept else (p < 1e-6)
    # the trials' noise streams are independent (own seeds): no correlation beyond chance
    c = torch.corrcoef(torch.stack([m.flatten() for m in moves]))
    assert (c - torch.eye(3)).abs().max() < 5 / moves[0].numel() ** 0.5


def test_seeds_alone_drive_sampling_and_noise() -> None:
    """Same configuration: same seed → identical runs; another seed → other batches and noise."""
    cfg = {"lr": 0.3, "clip": 0.5}
    runs = train_many(
        mlp(0),
        (X, Y),
        "dpsgd",
        [cfg] * 3,
        [5, 5, 6],
        noise_multiplier=1.0,
        steps=6,
        expected_batch_size=30,
        fallback="error",
        allow_shared_seeds=True,
    )
    for k in runs[0].final_params:
        assert torch.equal(runs[0].final_params[k], runs[1].final_params[k])
    assert not torch.allclose(runs[0].final_params["1.weight"], runs[2].final_params["1.weight"])
    assert [r["batch_size"] for r in runs[0].history] != [r["batch_size"] for r in runs[2].history]


def test_per_trial_noise_multipliers_targets_and_full_batch() -> None:
    cfgs = [{"lr": 0.1}, {"lr": 0.2}]
    got = train_many(
        mlp, (X, Y), "dpgd", cfgs, [1, 2], noise_multiplier=[0.7, 3.0], steps=5, full_batch=True, fallback="error"
    )
    for k, nu in enumerate([0.7, 3.0]):
        ref = train(
            mlp([1, 2][k]), (X, Y), "dpgd", seed=[1, 2][k], noise_multiplier=nu, steps=5, full_batch=True, **cfgs[k]
        )
        assert got[k].plan.noise_multiplier == nu
        assert_same_run(got[k], ref)
    got = train_many(
        mlp,
        (X, Y),
        "dpsgd",
        [{"lr": 0.1}] * 2,
        [3, 4],
        target_epsilon=[1.0, 8.0],
        delta=1e-5,
        accountant="rdp",
        steps=4,
        expected_batch_size=30,
        fallback="error",
    )
    assert got[0].plan.noise_multiplier > got[1].plan.noise_multiplier
    for r, target in zip(got, [1.0, 8.0], strict=True):  # each run spends what its own plan says
        assert r.ledger.matches(r.plan.event())
        assert r.epsilon(accountant="rdp") <= target


def test_a_diverging_trial_stops_alone() -> None:
    """Trial 2 diverges at its first step on every CPU: its output bias is already +inf (IEEE), so
    its logits and loss are not finite. (A huge lr, as before, overflowed on some CPUs only: on an
    Intel Xeon lr = 1e30 kept every parameter finite for 8 steps.)"""

    def models(seed: int) -> nn.Module:
        m = mlp(seed)
        if seed == 2:
            with torch.no_grad():
                m[-1].bias.fill_(float("inf"))
        return m

    cfgs = [{"lr": 0.1}, {"lr": 0.1}, {"lr": 0.2}]
    kw = dict(steps=8, expected_batch_size=40, eval_data=(XE, YE), eval_every=4)
    got = train_many(models, (X, Y), "nodp", cfgs, [1, 2, 3], fallback="error", **kw)
    assert [r.diverged for r in got] == [False, True, False]
    assert [len(r.history) for r in got] == [8, 1, 8]
    for k in range(3):
        ref = train(models(k + 1), (X, Y), "nodp", seed=k + 1, **kw, **cfgs[k])
        assert ref.diverged == got[k].diverged
        assert len(got[k].history) == len(ref.history)
        if not ref.diverged:
            assert_same_run(got[k], ref)


def test_reconstruction_task_mse() -> None:
    def ae(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(10, 4), nn.Sigmoid(), nn.Linear(4, 10))

    kw = dict(steps=6, expected_batch_size=40, eval_data=(XE, XE), eval_every=3)
    got = train_many(
        ae, (X, X), "dpsgd", [{"lr": 0.1, "clip": 0.5}] * 2, [7, 8], noise_multiplier=1.0, fallback="error", **kw
    )
    assert got[0].metric == "mse"
    for k, seed in enumerate([7, 8]):
        ref = train(ae(seed), (X, X), "dpsgd", seed=seed, noise_multiplier=1.0, lr=0.1, clip=0.5, **kw)
        assert_same_run(got[k], ref)


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


def test_unstackable_models_run_sequentially_or_refuse() -> None:
    with pytest.raises(ConfigError, match="cannot be stacked"):
        stack_plan(Custom())
    with pytest.raises(ConfigError, match="in-place"):
        stack_plan(nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True)))
    for conv in (
        nn.Conv2d(2, 4, 3, groups=2),
        nn.Conv2d(1, 4, 3, padding="same"),
        nn.Conv2d(1, 4, 3, padding_mode="circular"),
    ):
        with pytest.raises(ConfigError, match="only groups=1 and numeric zero padding"):
            stack_plan(nn.Sequential(conv, nn.Flatten(), nn.Linear(4, 2)))
    with pytest.raises(ConfigError, match="cannot be stacked"):
        stack_plan(nn.Sequential(nn.Conv2d(1, 4, 3), nn.MaxPool2d(2, return_indices=True)))
    frozen = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    frozen[0].bias.requires_grad_(False)
    with pytest.raises(ConfigError, match="frozen"):
        stack_plan(frozen)
    with pytest.raises(ConfigError, match="cannot be stacked"):
        train_many(
            lambda s: Custom(),
            (X, Y),
            "dpsgd",
            [{}],
            [0],
            noise_multiplier=1.0,
            steps=2,
            expected_batch_size=30,
            fallback="error",
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train_many(
            lambda s: Custom(),
            (X, Y),
            "dpsgd",
            [{}, {"lr": 0.3}],
            [0, 1],
            noise_multiplier=1.0,
            steps=3,
            expected_batch_size=30,
        )
    assert any("sequentially" in str(w.message) for w in caught)
    torch.manual_seed(0)
    ref = train(Custom(), (X, Y), "dpsgd", seed=1, noise_multiplier=1.0, steps=3, expected_batch_size=30, lr=0.3)
    assert len(got) == 2 and got[1].ledger.to_dict() == ref.ledger.to_dict()


def test_argument_forms_and_errors() -> None:
    base = mlp(3)

    def two_runs(models):
        return train_many(
            models,
            (X, Y),
            "dpsgd",
            [{"lr": 0.2}] * 2,
            [1, 2],
            noise_multiplier=1.0,
            steps=3,
            expected_batch_size=30,
            fallback="error",
        )

    a = two_runs(base)  # one model, copied per run
    b = two_runs([mlp(3), mlp(3)])  # a list of them: the same runs
    for r1, r2 in zip(a, b, strict=True):
        for k in r1.final_params:
            assert torch.equal(r1.final_params[k], r2.final_params[k])
    assert next(base.parameters()).data_ptr() != next(a[0].model.parameters()).data_ptr()  # copied, not shared
    seen: list[tuple[int, int]] = []
    train_many(
        mlp,
        (X, Y),
        "nodp",
        [{}] * 2,
        [1, 2],
        steps=3,
        expected_batch_size=30,
        on_step=lambda k, t, row: seen.append((k, t)),
        fallback="error",
    )
    assert sorted(seen) == [(k, t) for k in range(2) for t in range(1, 4)]
    with pytest.raises(ConfigError, match="disagree"):
        train_many(mlp, (X, Y), "dpsgd", [{}] * 2, [1, 2, 3], noise_multiplier=1.0, steps=2, expected_batch_size=30)
    with pytest.raises(ConfigError, match="differ in architecture"):
        train_many(
            [mlp(0), nn.Sequential(nn.Linear(10, 2))],
            (X, Y),
            "dpsgd",
            [{}] * 2,
            [1, 2],
            noise_multiplier=1.0,
            steps=2,
            expected_batch_size=30,
            fallback="error",
        )
    assert train_many(mlp, (X, Y), "dpsgd", [], [], noise_multiplier=1.0, steps=2, expected_batch_size=30) == []


def test_plans_and_per_trial_strategy_subclasses_as_the_tuner_passes_them() -> None:
    """The tuner's call: precomputed plans (here of different lengths), one Strategy instance
    per trial whose class overrides ``step`` with a hook, run ids. Each trial equals ``train``
    with the same plan: history, on_step rows, evaluation schedule (each trial's own last step)
    and the evaluation after an overridden ``finalize`` (dpgd's free final step)."""
    from dataclasses import fields

    from dptune.strategies import make_strategy
    from dptune.train import plan_run
    from dptune.tree import clone

    def hooked(lr: float, seen: list) -> object:
        base = type(make_strategy("dpgd"))

        def step(self, params, state, ctx):  # noqa: ANN001
            params, state, info = base.step(self, params, state, ctx)
            seen.append((ctx.t, clone(params)))
            return params, state, info

        cls = type(base.__name__, (base,), {"step": step, "__module__": base.__module__})
        proto = make_strategy("dpgd", lr=lr)
        return cls(**{f.name: getattr(proto, f.name) for f in fields(proto)})

    lrs, lengths, seeds = [0.2, 0.5], [3, 5], [21, 22]
    seen: list[list] = [[], []]
    plans = [
        plan_run(hooked(lr, seen[k]), X.shape[0], full_batch=True, steps=T, noise_multiplier=2.0)
        for k, (lr, T) in enumerate(zip(lrs, lengths, strict=True))
    ]
    rows: list[list] = [[], []]
    got = train_many(
        mlp,
        (X, Y),
        plans=plans,
        seeds=seeds,
        run_ids=["a", "b"],
        device="cpu",
        loss="cross_entropy",
        eval_data=(XE, YE),
        eval_every=2,
        fallback="error",
        on_step=lambda k, t, row: rows[k].append(row),
    )
    for k in range(2):
        seen_many = list(seen[k])
        seen[k].clear()  # the same strategy instance (and hook) runs the reference next
        ref_rows: list = []
        ref = train(
            mlp(seeds[k]),
            (X, Y),
            plans[k].strategy,
            plan=plans[k],
            seed=seeds[k],
            run_id="ab"[k],
            device="cpu",
            eval_data=(XE, YE),
            eval_every=2,
            on_step=lambda t, row, out=ref_rows: out.append(row),
        )
        assert_same_run(got[k], ref)
        assert rows[k] == got[k].history and ref_rows == ref.history and len(ref.history) == lengths[k]
        due = sorted({*range(2, lengths[k] + 1, 2), lengths[k]})
        assert [e["step"] for e in got[k].evals] == [*due, lengths[k]]
        assert got[k].evals[-1].get("finalized") == 1.0 and "finalized" not in got[k].evals[-2]
        assert [t for t, _ in seen_many] == [t for t, _ in seen[k]] == list(range(1, lengths[k] + 1))
        for (_, a), (_, b) in zip(seen_many, seen[k], strict=True):
            for name in a:
                torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fallback", ["error", "sequential"])
def test_train_many_keeps_private_evaluation_data_private_as_train_does(fallback: str) -> None:
    """Evaluation data is private unless declared public: the final iterates, as ``train`` gives,
    on the stacked and the sequential path alike; ``eval_public=True`` keeps the best."""
    kw = dict(steps=6, expected_batch_size=40, eval_data=(XE, YE), eval_every=2, noise_multiplier=0.8)
    model = mlp if fallback == "error" else (lambda s: torch.nn.Sequential(mlp(s), torch.nn.Identity()))
    private = train_many(model, (X, Y), "dpsgd", [{"lr": 0.3}] * 2, [1, 2], fallback=fallback, **kw)
    assert all(r.best_params is None and r.checkpoint == "final" and not r.eval_public for r in private)
    public = train_many(model, (X, Y), "dpsgd", [{"lr": 0.3}] * 2, [1, 2], fallback=fallback, eval_public=True, **kw)
    assert all(r.best_params is not None and r.checkpoint == "best" for r in public)
    with pytest.raises(ConfigError, match="declared public"):
        train_many(model, (X, Y), "dpsgd", [{"lr": 0.3}], [1], fallback=fallback, checkpoint="best", **kw)


@pytest.mark.parametrize("rows", [0, 1, 3])  # one chunk; chunks of 1 and 3 rows of 7 (forward and backward)
@pytest.mark.parametrize(
    ("k", "stride", "pad", "dil", "cin"), [(8, 2, 3, 1, 1), (4, 1, 0, 1, 16), ((3, 2), (1, 2), (0, 1), 2, 2)]
)
def test_convolutions_by_patches_equal_the_grouped_convolution(k, stride, pad, dil, cin, rows, monkeypatch) -> None:
    """CUDA's stacked Conv2d (``PatchConv``: batched products over patches, by chunks of rows) against the
    grouped convolution, in float64: the output and the gradient with respect to the input."""
    from dptune.gradients.stacked import PatchConv, geometry, trials_first

    mod, K = nn.Conv2d(cin, 3, k, stride, pad, dil), 3
    ho, wo = stacked_module.out_size((11, 11), geometry(mod))
    if rows:
        monkeypatch.setattr(stacked_module, "PATCH_BYTES", rows * K * cin * mod.weight[0, 0].numel() * ho * wo * 8)
    g = torch.Generator().manual_seed(0)
    h, W, b = (
        torch.randn(*s, generator=g, dtype=torch.float64) for s in ((K, 7, cin, 11, 11), (K, *mod.weight.shape), (K, 3))
    )
    h.requires_grad_()
    z = PatchConv.apply(h, W.flatten(2).transpose(1, 2), b, geometry(mod))
    ref = trials_first(F.conv2d(h.transpose(0, 1).flatten(1, 2), W.flatten(0, 1), b.flatten(), stride, pad, dil, K), K)
    torch.testing.assert_close(z, ref, rtol=1e-12, atol=1e-12)
    v = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (got,), (want,) = torch.autograd.grad((z * v).sum(), [h]), torch.autograd.grad((ref * v).sum(), [h])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gemm", [False, True])
def test_a_kernel_larger_than_its_input_is_refused_by_name(gemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacked_module, "gemm_patches", lambda device: gemm)
    model = lambda seed: nn.Sequential(nn.Conv2d(1, 2, 5), nn.Flatten(), nn.Linear(2, 2))  # noqa: E731
    x, y = torch.randn(50, 1, 4, 4), torch.randint(0, 2, (50,))
    with pytest.raises(ConfigError, match="the Conv2d '0': its kernel is larger than its input"):
        train_many(model, (x, y), "dpsgd", [{"clip": 1.0}] * 2, [0, 1], steps=2, expected_batch_size=10,
                   noise_multiplier=1.0, fallback="error")  # fmt: skip


def test_a_module_used_twice_is_stacked_as_used_or_refused() -> None:
    """Found in review: `named_children()` lists a module once, so a reused activation (or Linear) was
    dropped from the stacked forward: the trials trained another function than the model."""

    def shared_act(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        act = nn.Tanh()
        return nn.Sequential(nn.Linear(10, 6), act, nn.Linear(6, 6), act, nn.Linear(6, 2))

    assert [op.kind for op in stack_plan(shared_act(0))] == ["linear", "fn", "linear", "fn", "linear"]
    kw = dict(steps=4, expected_batch_size=40, noise_multiplier=0.8, eval_data=(XE, YE), eval_every=2)
    got = train_many(shared_act, (X, Y), "dpsgd", [{"lr": 0.5}], [3], fallback="error", **kw)
    assert_same_run(got[0], train(shared_act(3), (X, Y), "dpsgd", seed=3, lr=0.5, **kw))
    lin = nn.Linear(6, 6)
    with pytest.raises(ConfigError, match="used twice"):
        stack_plan(nn.Sequential(nn.Linear(10, 6), lin, nn.Tanh(), lin, nn.Linear(6, 2)))
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)
    b.weight = a.weight  # tied: one example's gradient is the sum of both uses, not two layers' norms
    with pytest.raises(ConfigError, match="shares parameters"):
        stack_plan(nn.Sequential(nn.Linear(10, 6), a, nn.Tanh(), b, nn.Linear(6, 2)))


def test_a_layout_the_stacked_forward_refuses_is_found_while_planning() -> None:
    """A Linear on [8, 8] per-example inputs was refused in the first stacked step, after the fallback
    (found in review): it is found while planning, and the trials run one by one as `train` runs them."""
    model = lambda seed: nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Flatten(), nn.Linear(32, 2))  # noqa: E731
    x, y = torch.randn(120, 8, 8), torch.randint(0, 2, (120,))
    kw = dict(steps=2, expected_batch_size=20, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="more than one dimension"):
        train_many(model, (x, y), "dpsgd", [{}, {}], [0, 1], fallback="error", **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train_many(model, (x, y), "dpsgd", [{}, {}], [0, 1], **kw)
    assert any("sequentially" in str(w.message) for w in caught) and len(got) == 2
    m = model(0)
    with pytest.raises(ConfigError, match="one model object serves several trials"):
        train_many([m, m], (X, Y), "dpsgd", steps=2, expected_batch_size=20, noise_multiplier=1.0)
