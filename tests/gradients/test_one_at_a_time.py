"""Per-example gradients of models ``torch.func.vmap`` cannot run (a Python branch on a tensor's
value, as Hugging Face's attention-mask preparation has): the oracle computes each example's
gradient by its own forward and backward pass (``GradientOracle._one_at_a_time``), exact, with a
warning; buffer writes are still refused and other errors still raised (no transformers needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptune
from dptune.errors import ConfigError
from dptune.gradients.oracle import GradientOracle

pytestmark = pytest.mark.usefixtures("one_thread")


class Branchy(nn.Module):
    """Skips a masking step when the mask is all ones, like ``transformers.masking_utils``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if not mask.all():  # data-dependent control flow
            h = h * mask.unsqueeze(-1)
        return self.b(h.mean(1))


def _batch(n: int = 7):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, 4, generator=g)
    mask = (torch.rand(n, 5, generator=g) > 0.3).float()
    mask[0] = 1.0
    return {"x": x, "mask": mask}, torch.randint(0, 3, (n,), generator=g)


def test_vmap_refused_model_gets_exact_single_example_gradients() -> None:
    torch.manual_seed(0)
    model = Branchy()
    x, y = _batch()
    oracle = GradientOracle(model, method="vmap")
    params = {k: p.detach() for k, p in model.named_parameters()}
    with pytest.warns(RuntimeWarning, match="one example at a time"):
        g = oracle(params, x, y)
    assert oracle.alone_reason is not None and "vmap" in oracle.alone_reason
    for i in range(7):
        model.zero_grad()
        F.cross_entropy(model(x["x"][i : i + 1], x["mask"][i : i + 1]), y[i : i + 1]).backward()
        exact = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().norm()
        assert exact <= g.norms[i] <= exact * (1 + 1e-3)  # an upper bound (upper_norms)
        for k, p in model.named_parameters():
            assert torch.equal(g.grads[k][i], p.grad), (i, k)
    g2 = oracle(params, x, y)  # the decision is kept: no second vmap attempt, same values
    assert all(torch.equal(g.grads[k], g2.grads[k]) for k in g.grads)


def test_vmap_refused_model_trains_and_auto_probe_still_applies() -> None:
    x, y = _batch(60)
    for method in ("vmap", "auto"):
        torch.manual_seed(0)
        with pytest.warns(RuntimeWarning):
            res = dptune.train(Branchy(), (x, y), "dpsgd", steps=3, expected_batch_size=10, noise_multiplier=1.0,
                               device="cpu", lr=0.1, grad_method=method)  # fmt: skip
        assert res.ledger.matches(res.plan.event())


class WritesBuffer(Branchy):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.sum())
        return super().forward(x, mask)


def test_buffer_writes_and_plain_errors_are_not_hidden_by_the_fallback() -> None:
    x, y = _batch()
    model = WritesBuffer()
    with pytest.raises(ConfigError, match="buffer"):
        GradientOracle(model, method="vmap")({k: p.detach() for k, p in model.named_parameters()}, x, y)
    model = Branchy()
    with pytest.raises(ConfigError, match="fails on one example alone .*(shape|size)"):
        GradientOracle(model, method="vmap")(
            {k: p.detach() for k, p in model.named_parameters()}, {"x": x["x"][..., :3], "mask": x["mask"]}, y
        )


def test_models_vmap_can_run_stay_on_vmap() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    oracle = GradientOracle(model, method="vmap")
    oracle({k: p.detach() for k, p in model.named_parameters()}, torch.randn(5, 4), torch.zeros(5, dtype=torch.long))
    assert oracle.alone_reason is None


class BroadcastPositions(nn.Module):
    """Token plus position embeddings, the positions looked up once as ids [T] and broadcast over
    the batch. With T equal to the batch size, the position embedding's rows look like one per
    example to the ghost path, which files the batch's summed gradient of position j under example
    j: only the ghost path mixes (shared ids [1, T], BERT's, are expanded to the batch instead)."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self, T: int = 8) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(20, 8), nn.Embedding(T, 8), nn.Linear(8, 3)
        self.register_buffer("position_ids", torch.arange(T))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tok(ids) + self.pos(self.position_ids)).mean(1))


def test_auto_moves_to_vmap_when_only_the_ghost_path_mixes_and_forced_ghost_refuses() -> None:
    torch.manual_seed(0)
    model = BroadcastPositions()
    ids, y = torch.randint(0, 20, (8, 8)), torch.randint(0, 3, (8,))
    params = {k: p.detach() for k, p in model.named_parameters()}
    oracle = GradientOracle(model, method="auto")
    with pytest.warns(RuntimeWarning, match="mixes examples"):
        g = oracle(params, ids, y)
    assert oracle.method == "vmap"
    for i in range(8):
        model.zero_grad()
        F.cross_entropy(model(ids[i : i + 1]), y[i : i + 1]).backward()
        exact = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().norm()
        assert exact <= g.norms[i] <= exact * (1 + 1e-3)
    with pytest.raises(ConfigError, match="depends on other examples"):
        GradientOracle(model, method="ghost")(params, ids, y)


def test_a_runtime_error_of_the_ghost_path_moves_auto_to_vmap_and_is_raised_when_forced(monkeypatch) -> None:
    """E.g. a layer rule that cannot handle the shapes it recorded (MiniLM's position embedding
    once gave "index_add_(): Number of indices (64) should be equal to source.size(dim)")."""
    from dptune.gradients import ghost

    def broken(self, *args):  # noqa: ANN001, ANN002, ANN202, ARG001
        raise RuntimeError("index_add_(): Number of indices (64) should be equal to source.size(dim): (4352)")

    monkeypatch.setattr(ghost.GhostEngine, "__call__", broken)
    model = nn.Sequential(nn.Linear(4, 3))
    params = {k: p.detach() for k, p in model.named_parameters()}
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    oracle = GradientOracle(model, method="auto")
    with pytest.warns(RuntimeWarning, match="index_add_"):
        g = oracle(params, x, y)
    assert oracle.method == "vmap" and g.norms.shape == (6,)
    with pytest.raises(RuntimeError, match="index_add_"):
        GradientOracle(model, method="ghost")(params, x, y)


class Recurrent(nn.Module):
    """nn.GRU: vmap fails on its shapes with a message that does not say 'vmap' (a raw traceback before)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.rnn, self.out = nn.GRU(4, 6, batch_first=batch_first), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_model_vmap_fails_on_is_computed_one_example_at_a_time(batch_first: bool) -> None:
    model, x, y = Recurrent(batch_first), torch.randn(6, 5, 4), torch.randint(0, 3, (6,))
    params = {k: p.detach() for k, p in model.named_parameters()}
    with pytest.warns(RuntimeWarning, match="one example at a time"):
        got = GradientOracle(model, method="vmap")(params, x, y)
    for i in (0, 5):  # exact: each example's own backward pass
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for k, p in model.named_parameters():
            assert torch.allclose(got.grads[k][i], p.grad, atol=1e-6), k


class OldStyleNorm(nn.Module):
    """Running statistics written through ``.data`` into a frozen parameter: no version counter moves."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.running_mean = nn.Linear(4, 3), nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running_mean.data.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x - self.running_mean)


@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_a_frozen_parameter_written_through_data_is_refused(method: str) -> None:
    """Found in review: the trained model held the exact mean of the private batches."""
    x, y = torch.randn(64, 4) + 3.0, torch.randint(0, 3, (64,))
    # auto: the frozen parameters' fingerprint; vmap refuses the write, then one at a time sees the state
    with pytest.raises(ConfigError, match="frozen parameter.*running_mean|depends on the examples before"):
        dptune.train(OldStyleNorm(), (x, y), "dpsgd", steps=3, expected_batch_size=16, noise_multiplier=1.0,
                     delta=1e-3, grad_method=method)  # fmt: skip


def test_a_model_that_fails_on_one_example_is_one_clear_error() -> None:
    class BatchStats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(F.batch_norm(x, None, None, training=True))

    model, x, y = BatchStats(), torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ConfigError, match="fails on one example alone .*GroupNorm or LayerNorm"):
        GradientOracle(model, method="vmap")({k: p.detach() for k, p in model.named_parameters()}, x, y)
