"""The ghost-norm / book-keeping path (``dptune.gradients.ghost``) against the vmap path.

Every optimisation has an equivalence test against the straightforward path: per-batch
norms, losses, weighted sums and materialised gradients on the paper models and on small
models covering every layer rule, then whole training runs of every strategy with both
paths (same seed: same batches, same noise), compared parameter by parameter.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptune import models
from dptune.errors import ConfigError
from dptune.gradients import ghost
from dptune.gradients.oracle import GradientOracle, MaterializedGrads, default_method, set_default_method
from dptune.release.privatizers import clip_weights
from dptune.strategies import STRATEGIES
from dptune.train import train

pytestmark = pytest.mark.usefixtures("one_thread")


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


class SeqModel(nn.Module):
    """Embedding (padding_idx) → LayerNorm → Linear over tokens → Conv1d → pooled Linear."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 6, padding_idx=0)
        self.ln = nn.LayerNorm(6)
        self.tok = nn.Linear(6, 5)
        self.conv = nn.Conv1d(5, 4, 3, padding=1, stride=1, dilation=1)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.tok(self.ln(self.emb(x))))
        return self.out(torch.relu(self.conv(h.transpose(1, 2))).mean(2))


class GeometryCNN(nn.Module):
    """Strided, padded, dilated Conv2d, GroupNorm, a bias-free conv, a stride-2 transposed conv."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 6, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(3, 6)
        self.c2 = nn.Conv2d(6, 4, 3, padding=2, dilation=2, bias=False)
        self.up = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
        self.fc = nn.Linear(3 * 10 * 10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.gn(self.c1(x)))
        h = torch.relu(self.c2(h))
        return self.fc(torch.sigmoid(self.up(h)).flatten(1))


def _frozen_mlp() -> nn.Module:
    m = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 3))
    m[0].weight.requires_grad_(False)  # a frozen weight with a trainable bias
    return m


def case(name: str, g: torch.Generator) -> tuple[nn.Module, torch.Tensor, torch.Tensor, str]:
    B = 6
    if name == "galli_cnn":
        return (
            models.galli_cnn(),
            torch.rand(B, 1, 28, 28, generator=g),
            torch.randint(0, 10, (B,), generator=g),
            "cross_entropy",
        )
    if name == "galli_autoencoder":
        x = torch.rand(B, 1, 28, 28, generator=g)
        return models.galli_autoencoder(), x, x, "mse"
    if name == "galli_bow_fc":
        return (
            models.galli_bow_fc(input_dim=40),
            torch.randn(B, 40, generator=g),
            torch.randint(0, 4, (B,), generator=g),
            "cross_entropy",
        )
    if name == "mlp":
        return models.mlp(), torch.rand(B, 784, generator=g), torch.randint(0, 10, (B,), generator=g), "cross_entropy"
    if name == "seq":
        x = torch.randint(0, 30, (B, 7), generator=g)
        x[:, -2:] = 0  # padding tokens, and repeated tokens within an example
        x[:, 1] = x[:, 2]
        return SeqModel(), x, torch.randint(0, 3, (B,), generator=g), "cross_entropy"
    if name == "geometry":
        return (
            GeometryCNN(),
            torch.randn(B, 2, 10, 10, generator=g),
            torch.randint(0, 4, (B,), generator=g),
            "cross_entropy",
        )
    if name == "frozen":
        return _frozen_mlp(), torch.randn(B, 7, generator=g), torch.randint(0, 3, (B,), generator=g), "cross_entropy"
    if name == "bce":
        return (
            nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1)),
            torch.randn(B, 5, generator=g),
            torch.randint(0, 2, (B,), generator=g),
            "bce",
        )
    raise ValueError(name)


CASES = ["galli_cnn", "galli_autoencoder", "galli_bow_fc", "mlp", "seq", "geometry", "frozen", "bce"]


def _compare(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str, rtol: float, atol: float) -> None:
    p = params_of(model)
    got = GradientOracle(model, loss, method="ghost")(p, x, y)
    ref = GradientOracle(model, loss, method="vmap")(p, x, y)
    assert isinstance(got, ghost.GhostGrads)
    torch.testing.assert_close(got.losses, ref.losses, rtol=rtol, atol=atol)
    torch.testing.assert_close(got.norms, ref.norms, rtol=rtol, atol=atol)
    w = torch.linspace(-1.0, 2.0, x.shape[0], dtype=x.dtype if x.is_floating_point() else torch.float32)
    ws, wr = got.weighted_sum(w), ref.weighted_sum(w)
    assert list(ws) == list(wr)  # same parameters, same order
    for k in wr:
        torch.testing.assert_close(ws[k], wr[k], rtol=rtol, atol=atol, msg=k)
    for k in ref.grads:  # the materialised per-sample gradients, for code that reads them
        torch.testing.assert_close(got.grads[k], ref.grads[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("name", CASES)
def test_ghost_equals_vmap_on_one_batch(name: str) -> None:
    torch.manual_seed(0)
    model, x, y, loss = case(name, torch.Generator().manual_seed(1))
    _compare(model, x, y, loss, rtol=1e-5, atol=1e-6)


def _yours(model: nn.Module) -> nn.Module:
    """The model as a class of yours, not declared row-wise: its forward runs under vmap."""
    model.__class__ = type("Yours", (type(model),), {"dptune_rowwise": False})
    return model


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no fallback: the row-wise ghost path itself
@pytest.mark.parametrize("name", ["seq", "geometry", "galli_autoencoder", "bce", "frozen"])
def test_your_forward_takes_the_ghost_path_under_vmap(name: str) -> None:
    """The ghost rules on each example's layer inputs and output gradients computed alone (vmap of a vjp):
    the same losses, norms, sums and gradients as the vmap path, for 'auto' and 'ghost' alike."""
    torch.manual_seed(0)
    model, x, y, loss = case(name, torch.Generator().manual_seed(3))
    oracle = GradientOracle(_yours(model), loss)
    assert oracle.method == "ghost" and oracle._ghost.rowwise
    _compare(model, x, y, loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("yours", [False, True])
@pytest.mark.parametrize("name", ["seq", "geometry"])
def test_ghost_equals_vmap_in_float64(name: str, yours: bool) -> None:
    """In double precision the two paths agree to ~1e-12: the maths is the same, not approximately."""
    torch.manual_seed(0)
    model, x, y, loss = case(name, torch.Generator().manual_seed(2))
    model = _yours(model.double()) if yours else model.double()
    x = x.double() if x.is_floating_point() else x
    y = y.double() if y.is_floating_point() else y
    _compare(model, x, y, loss, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a fallback to vmap would hide a wrong path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["galli_cnn", "galli_autoencoder", "seq", "geometry"])
@pytest.mark.parametrize("kept", [True, False])
def test_unfold_products_equal_vmap(monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype, kept: bool) -> None:
    """Convolutions by im2col + batched GEMM (the CUDA path), forced on the CPU, kept (case (a))
    or recomputed for the release (case (e), the large-batch path): the same norms, sums and
    per-sample gradients as vmap (float64: to 1e-12, the same maths), in chunks of one example,
    across padding, stride, dilation, Conv1d and a model that also has transposed convolutions
    (which keep the grouped kernel)."""
    if not kept:
        monkeypatch.setattr(ghost, "MATERIALIZE_LIMIT_BYTES", 256)
    asked: list[bool] = []

    def unfold_everywhere(device: torch.device, transposed: bool, patch_bytes: int) -> bool:
        asked.append(transposed)
        return not transposed

    monkeypatch.setattr(ghost, "use_unfold_products", unfold_everywhere)
    monkeypatch.setattr(ghost, "UNFOLD_PRODUCT_BYTES", 1)  # one example per chunk
    torch.manual_seed(0)
    model, x, y, loss = case(name, torch.Generator().manual_seed(3))
    model = model.to(dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    y = y.to(dtype) if y.is_floating_point() else y
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    _compare(model, x, y, loss, **tol)
    assert False in asked  # the unfold path ran for at least one convolution


def _convs_then_linear(convs: nn.Sequential, x: torch.Tensor, classes: int = 3) -> nn.Sequential:
    with torch.no_grad():
        width = convs(x[:1]).flatten(1).shape[1]
    return nn.Sequential(*convs, nn.Flatten(), nn.Linear(width, classes, dtype=x.dtype))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a fallback to vmap would hide a wrong path
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted"])
@pytest.mark.parametrize("geometry", ["conv2d", "conv1d"])
def test_unfold_products_pin_each_axis(monkeypatch: pytest.MonkeyPatch, geometry: str, layout: str) -> None:
    """Asymmetric kernels, strides, paddings and dilations (a swapped axis fails), Conv1d with all
    three, and inputs that are channels-last or a permuted view: the GEMM path equals vmap to
    float64 precision."""
    monkeypatch.setattr(ghost, "use_unfold_products", lambda device, transposed, patch_bytes: not transposed)
    monkeypatch.setattr(ghost, "UNFOLD_PRODUCT_BYTES", 1)
    g = torch.Generator().manual_seed(4)
    if geometry == "conv2d":
        x = torch.randn(6, 3, 9, 17, generator=g, dtype=torch.float64)
        convs = nn.Sequential(
            nn.Conv2d(3, 4, (2, 5), stride=(1, 3), padding=(2, 0), dilation=(3, 1)),
            nn.Tanh(),
            nn.Conv2d(4, 2, (3, 1), stride=(2, 1), padding=(0, 1), dilation=(1, 2)),
        ).double()
    else:
        x = torch.randn(6, 3, 20, generator=g, dtype=torch.float64)
        convs = nn.Sequential(nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2)).double()
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "permuted":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous strides
    torch.manual_seed(0)
    model = _convs_then_linear(convs, x)
    _compare(model, x, torch.randint(0, 3, (6,), generator=g), "cross_entropy", rtol=1e-10, atol=1e-12)


def test_unfold_products_only_on_cuda_for_plain_convolutions_that_fit() -> None:
    cuda, fits, too_big = torch.device("cuda"), ghost.UNFOLD_PRODUCT_BYTES, ghost.UNFOLD_PRODUCT_BYTES + 1
    assert ghost.use_unfold_products(cuda, transposed=False, patch_bytes=fits)
    assert not ghost.use_unfold_products(cuda, transposed=False, patch_bytes=too_big)
    assert not ghost.use_unfold_products(cuda, transposed=True, patch_bytes=1)
    assert not ghost.use_unfold_products(torch.device("cpu"), transposed=False, patch_bytes=1)


def test_unstored_and_gram_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no room to keep per-sample gradients: Gram (ghost) norms for Linear over tokens and
    for small-output convolutions, native weight-gradient kernels for the weighted sums."""
    monkeypatch.setattr(ghost, "MATERIALIZE_LIMIT_BYTES", 0)
    monkeypatch.setattr(ghost, "UNFOLD_CHUNK_BYTES", 1)  # one example per chunk
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3),
        nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 3, stride=2),
        nn.Flatten(2),
        nn.Linear(81, 20),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(8 * 20, 3),
    )
    x, y = torch.randn(5, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    model = model.double()
    # The first conv: T = 16 output positions, p·d = 16·27: T(p + d) < p·d, so the Gram rule runs.
    _compare(model, x, y, "cross_entropy", rtol=1e-10, atol=1e-12)


def test_second_weighted_sum_reuses_the_first_exactly() -> None:
    """OSO's q-weights are (w_clip − 1[‖g‖ ≤ C])/C: the residual trick must give the direct sum."""
    torch.manual_seed(0)
    model, x, y, loss = case("galli_bow_fc", torch.Generator().manual_seed(3))
    p = params_of(model)
    oracle = GradientOracle(model, loss, method="ghost")
    norms = oracle(p, x, y).norms
    for clip in (float(norms.min()) / 2, float(norms.median()), float(norms.max()) * 2):
        g = oracle(p, x, y)
        w_clip = clip_weights(g.norms, clip)
        w_q = torch.where(g.norms > clip, 1.0 / g.norms, torch.zeros_like(g.norms))
        g.weighted_sum(w_clip)
        reused = g.weighted_sum(w_q)
        fresh = oracle(p, x, y).weighted_sum(w_q)
        for k in fresh:
            torch.testing.assert_close(reused[k], fresh[k], rtol=1e-5, atol=1e-7)
    # Unrelated weights: no reuse, still exact.
    g = oracle(p, x, y)
    g.weighted_sum(torch.rand(x.shape[0]))
    w2 = torch.rand(x.shape[0])
    for k, v in g.weighted_sum(w2).items():
        torch.testing.assert_close(v, oracle(p, x, y).weighted_sum(w2)[k], rtol=1e-6, atol=1e-7)


def _train_both(strategy: str, model_fn, data, **kw):
    out = {}
    for method in ("vmap", "ghost"):
        with default_method(method):
            torch.manual_seed(0)
            out[method] = train(model_fn(), data, strategy, seed=7, **kw)
    return out["vmap"], out["ghost"]


STRATEGY_RUNS = {
    "nodp": {"lr": 0.2},
    "dpsgd": {"lr": 0.2, "clip": 0.5, "momentum": 0.5},
    "quantile": {"lr": 0.2, "initial_clip": 0.3},
    "oso": {"lr": 0.2, "initial_clip": 0.2, "clip_lr": 0.05, "lr_lr": 0.05},
    "dpadam": {"lr": 0.01},
    "adamwosm": {"clip": 0.5},
    "dpgd": {"lr": 0.2},
    "adadp": {},
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_trains_identically_on_both_paths(strategy: str) -> None:
    """Same seed, both gradient paths: the same batches, noise, releases and parameters."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 12, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.3 * torch.randn(96, generator=g, dtype=torch.float64) > 0).long()

    def model_fn() -> nn.Module:
        return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 2)).double()

    kw = dict(STRATEGY_RUNS.get(strategy, {}))
    batch = {"full_batch": True} if strategy == "dpgd" else {"expected_batch_size": 24}
    nu = {} if strategy == "nodp" else {"noise_multiplier": 1.0}
    a, b = _train_both(strategy, model_fn, (x, y), steps=6, **batch, **nu, **kw)
    assert a.ledger.to_dict() == b.ledger.to_dict()
    for k in a.final_params:
        torch.testing.assert_close(b.final_params[k], a.final_params[k], rtol=1e-5, atol=1e-10)
    assert not torch.equal(a.final_params["0.weight"], model_fn().state_dict()["0.weight"])  # it trained
    for ra, rb in zip(a.history, b.history, strict=True):
        for key in ("clip", "lr", "train_loss"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-6), key


def test_paper_cnn_trains_identically_on_both_paths() -> None:
    """A few DP-SGD and OSO steps of the Galli CNN itself (convolutions, max-pool, 551k params)."""
    g = torch.Generator().manual_seed(9)
    x = torch.rand(24, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (24,), generator=g)
    for strategy, kw in (("dpsgd", {"lr": 0.1, "clip": 0.5}), ("oso", {"lr": 0.1, "initial_clip": 0.3})):
        a, b = _train_both(
            strategy, models.galli_cnn, (x, y), steps=2, expected_batch_size=8, noise_multiplier=1.0, **kw
        )
        for k in a.final_params:
            torch.testing.assert_close(b.final_params[k], a.final_params[k], rtol=1e-5, atol=1e-6)


class Scale(nn.Module):
    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def test_unsupported_layer_falls_back_to_vmap_or_refuses() -> None:
    model = nn.Sequential(nn.Linear(4, 3), Scale(), nn.Linear(3, 2))
    oracle = GradientOracle(model, method="auto")
    assert oracle.method == "vmap" and "no ghost rule" in (oracle.fallback_reason or "")
    with pytest.raises(ConfigError, match="method='vmap'"):
        GradientOracle(model, method="ghost")


class Twice(nn.Module):
    """The same Linear applied twice (weight sharing): the one-call rule does not hold."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class Sneaky(nn.Module):
    """Uses a Linear's weight outside the Linear (F.linear): invisible to the static check."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)) + F.linear(x, self.lin.weight))


@pytest.mark.parametrize("make", [Twice, Sneaky])
def test_runtime_fallbacks_are_detected_and_correct(make) -> None:
    """Weight sharing and parameters used outside their layer are caught (call count, the
    first-batch probe): 'auto' then returns the vmap result."""
    torch.manual_seed(0)
    model = make()
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    p = params_of(model)
    auto = GradientOracle(model, method="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = auto(p, x, y)
    ref = GradientOracle(model, method="vmap")(p, x, y)
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-7)
    assert auto.method == "vmap" and any("fall back to vmap" in str(w.message) for w in caught)
    assert type(got) is MaterializedGrads


def test_an_in_place_change_of_a_layer_output_keeps_the_ghost_path() -> None:
    """ReLU(inplace=True) on a Linear's output: the output gradient is taken at the layer's own autograd
    edge (``recording``), so the ghost norms and sums equal the vmap ones (an in-place change of a layer's
    INPUT still falls back: the rule would read the changed input)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 2))
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    p = params_of(model)
    auto, ref = GradientOracle(model, method="auto"), GradientOracle(model, method="vmap")
    got, want = auto(p, x, y), ref(p, x, y)
    assert auto.method == "ghost"
    torch.testing.assert_close(got.norms, want.norms, rtol=1e-5, atol=1e-7)
    w = torch.rand(6)
    for k, v in want.weighted_sum(w).items():
        torch.testing.assert_close(got.weighted_sum(w)[k], v, rtol=1e-5, atol=1e-7)


def test_empty_batch_and_default_method_switch() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    g = GradientOracle(model, method="ghost")(params_of(model), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    assert g.norms.shape == (0,)
    assert all(not v.any() for v in g.weighted_sum(torch.zeros(0)).values())
    with default_method("vmap"):
        assert GradientOracle(model).method == "vmap"
    assert GradientOracle(model, method="auto").method == "ghost"
    with pytest.raises(ConfigError, match="unknown gradient method"):
        set_default_method("fast")
    with pytest.raises(ConfigError, match="unknown gradient method"):
        GradientOracle(model, method="opacus")


def test_active_dropout_keeps_the_ghost_path() -> None:
    """With random masks the two paths cannot agree on a probe; 'auto' must not read that as
    a fault (per-example losses with per-example masks are still per-example)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    oracle = GradientOracle(model, method="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = oracle(params_of(model), torch.randn(5, 6), torch.randint(0, 2, (5,)))
    assert oracle.method == "ghost" and isinstance(g, ghost.GhostGrads)


def test_large_batches_keep_what_fits_per_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25's collapse: a fixed cap sent a layer of 32 KiB per example to the recomputing
    rules above 2,048 examples (two passes per sum). The cap now grows with the batch: at 2,100
    examples the layer keeps its per-sample gradients, with the norms and the sum of the old rule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 4), nn.Flatten(), nn.Linear(32 * 4, 3))
    x, y = torch.randn(2100, 16, 5, 5), torch.randint(0, 3, (2100,))
    engine = ghost.GhostEngine(model, lambda out, t: F.cross_entropy(out, t, reduction="none"))
    params = params_of(model)
    kept = engine(params, x, y, {})
    assert 2100 * 8192 * 4 > ghost.MATERIALIZE_LIMIT_BYTES == 64 * 2**20  # over the old cap
    assert kept._layers[0].G is not None and ghost.keep_limit(2100) == 64 * 2**20 * 2100 // 1024
    monkeypatch.setattr(ghost, "keep_limit", lambda batch: ghost.MATERIALIZE_LIMIT_BYTES)  # the old rule
    old = engine(params, x, y, {})
    assert old._layers[0].G is None
    # The old rule here is the Gram form (T = 4), whose bound adds its rounding slack on top.
    torch.testing.assert_close(kept.norms, old.norms, rtol=1e-4, atol=0)
    assert bool((old.norms >= kept.norms * (1 - 1e-6)).all())
    w = clip_weights(kept.norms, 0.1)
    new_sum, old_sum = kept.weighted_sum(w), old.weighted_sum(w)
    for k in new_sum:
        torch.testing.assert_close(new_sum[k], old_sum[k], rtol=1e-5, atol=1e-7)
