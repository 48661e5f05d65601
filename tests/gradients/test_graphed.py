"""The CUDA-graph path's padding and replay logic (``gradients.graphed``), on the CPU: there a "capture"
is the function itself, re-run on each replay, so everything but the graph (static buffers, padding
with the first row at weight 0, the bucket size, the eager fallbacks) is checked here; the graphs
themselves in tests/gradients/test_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dptune
from dptune.gradients import graphed
from dptune.gradients.oracle import GradientOracle
from dptune.strategies import STRATEGIES


@pytest.fixture(autouse=True)
def _small_batches_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphed, "MAX_PADDING", math.inf)  # these batches are small: replayed all the same


def _setup(B: int = 13) -> tuple[GradientOracle, dict, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    oracle = GradientOracle(model, "cross_entropy", method="ghost")
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return oracle, params, torch.randn(B, 6), torch.randint(0, 3, (B,))


def _wide(acc: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in acc.wide.values()])


def test_a_padded_replay_releases_what_the_unpadded_batch_does() -> None:
    oracle, params, x, y = _setup()
    graphs = graphed.Graphs(oracle._run_ghost, oracle.model)
    assert graphed.padded_size(13) == 40 and graphed.padded_size(1000) == 1136
    for step in range(3):  # the static buffers are reloaded each step
        x[0] *= 50.0  # the padding copies row 0: however large its gradient, it adds 0·g
        got = graphs(params, x, y)
        assert isinstance(got, graphed.Replayed) and got.batch_size == 13 and graphs.replays == step + 1
        eager = oracle._run_ghost(params, x, y)
        torch.testing.assert_close(got.norms, eager.norms, rtol=1e-6, atol=0)
        torch.testing.assert_close(got.losses, eager.losses)
        w = torch.rand(13)
        torch.testing.assert_close(_wide(got.weighted_sum(w)), _wide(eager.weighted_sum(w)), rtol=1e-12, atol=1e-15)
        for k, g in eager.grads.items():
            torch.testing.assert_close(got.grads[k], g, rtol=1e-6, atol=1e-7)
        params = {k: v + 0.01 for k, v in params.items()}


def test_what_the_graph_cannot_take_runs_eagerly() -> None:
    oracle, params, x, y = _setup()
    graphs = graphed.Graphs(oracle._run_ghost, oracle.model)
    assert graphs(params, x, y) is not None
    big = torch.randn(41, 6)  # above the captured 40 rows: captured again, at its own padded size
    got = graphs(params, big, torch.zeros(41, dtype=torch.long))
    assert got is not None and got.batch_size == 41 and graphs._cap.size == graphed.padded_size(41)
    torch.testing.assert_close(got.norms, oracle._run_ghost(params, big, torch.zeros(41, dtype=torch.long)).norms)
    x[3, 0] = float("nan")  # a non-finite norm: the step is computed eagerly (its own rule)
    assert graphs(params, x, y) is None
    assert (graphs.replays, graphs.eager) == (2, 1)
    x[3, 0] = 0.0
    oracle.model.eval()  # a change the graph would not see: captured again
    before = graphs._cap
    assert graphs(params, x, y) is not None and graphs._cap is not before and graphs.replays == 3


class _Tokens(nn.Module):
    """Linear over tokens, then the mean: any sequence length T."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)).mean(1))


def test_a_new_input_shape_or_dtype_is_captured_again() -> None:
    """The static buffers are shaped and typed by the first batch: a batch padded to another length T, or a
    model moved to float64, is captured again (on a GPU it replayed stale rows or failed in ``copy_``)."""
    torch.manual_seed(0)
    model = _Tokens()
    oracle = GradientOracle(model, "cross_entropy", method="ghost")
    graphs = graphed.Graphs(oracle._run_ghost, model)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    y = torch.randint(0, 3, (13,))
    for T in (10, 10, 1, 7):
        x = torch.randn(13, T, 6)
        before = graphs._cap
        got = graphs(params, x, y)
        assert got is not None and (graphs._cap is before) == (before is not None and before.key[0][0][0] == (T, 6))
        torch.testing.assert_close(got.norms, oracle._run_ghost(params, x, y).norms)
    model.double()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    before, x = graphs._cap, torch.randn(13, 7, 6, dtype=torch.float64)
    got = graphs(params, x, y)
    assert got is not None and graphs._cap is not before and got.norms.dtype == torch.float64


def test_tied_weights_leave_the_ghost_path() -> None:
    """A parameter shared by two layers (an LM head tied to the embedding): its per-example gradient is the
    sum of both layers' terms, which no rule bounds; ghost released the first layer's part only."""
    from dptune.gradients.ghost_layers import unsupported_reason

    emb, head = nn.Embedding(11, 4), nn.Linear(4, 11, bias=False)
    head.weight = emb.weight
    reason = unsupported_reason(nn.Sequential(emb, head))
    assert reason is not None and "tied" in reason
    assert unsupported_reason(nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))) is None


def test_a_refused_capture_turns_graphs_off_for_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    oracle, params, x, y = _setup()

    def host_read(*a: object) -> object:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = graphed.Graphs(host_read, oracle.model)
    with pytest.warns(RuntimeWarning, match="CUDA graphs off"):
        assert graphs(params, x, y) is None
    assert graphs(params, x, y) is None and "not permitted" in str(graphs.off_reason)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_trains_the_same_run_on_replayed_gradients(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every registered strategy through ``dptune.train`` with the oracle's replay path on (on the CPU a
    "replay" re-runs the padded batch): the same batches, ledger and model as the eager run, within
    the float64 reassociation of the padded sums."""
    x, y = torch.randn(120, 6), torch.randint(0, 3, (120,))
    model = lambda: _setup()[0].model  # noqa: E731 - the same seeded model each time
    private = STRATEGIES[name]().private
    batch = {"full_batch": True} if name == "dpgd" else {"expected_batch_size": 24}
    kw = {"steps": 6, "seed": 3, "noise_multiplier": 1.0 if private else None, "grad_method": "ghost", **batch}
    eager = dptune.train(model(), (x, y), name, **kw)
    calls: list[bool] = []
    real = graphed.Graphs.__call__
    monkeypatch.setattr(graphed, "replayable", lambda device: True)
    monkeypatch.setattr(graphed.Graphs, "__call__", lambda self, *a: calls.append(True) or real(self, *a))
    # the first probe only: later probe calls, at random (OS entropy), run eagerly and made the count flaky
    monkeypatch.setattr(GradientOracle, "_gap", lambda self: 10**6)
    replayed = dptune.train(model(), (x, y), name, **kw)
    assert len(calls) >= (4 if name not in ("dpzo", "nodp") else 0), calls
    assert replayed.ledger.matches(replayed.plan.event()) and replayed.ledger.releases == eager.ledger.releases
    assert [r["batch_size"] for r in replayed.history] == [r["batch_size"] for r in eager.history]
    for k, v in eager.final_params.items():
        torch.testing.assert_close(replayed.final_params[k], v, rtol=1e-4, atol=1e-6)


def test_a_batch_that_would_be_padded_beyond_half_again_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MAX_PADDING``: 32 rows would pad to 64 (twice the work and the kept state): no capture, every step
    eager; 256 rows pad to 328 (1.28×): captured."""
    monkeypatch.setattr(graphed, "MAX_PADDING", 1.5)
    assert graphed.padded_size(32) == 64 and graphed.padded_size(256) == 328
    oracle, params, x, y = _setup(32)
    graphs = graphed.Graphs(oracle._run_ghost, oracle.model)
    assert graphs(params, x, y) is None and graphs(params, x, y) is None
    assert graphs._cap is None and "padded to 64 rows" in (graphs.off_reason or "") and graphs.eager == 2
    oracle, params, x, y = _setup(256)
    graphs = graphed.Graphs(oracle._run_ghost, oracle.model)
    assert graphs(params, x, y) is not None and graphs._cap is not None and graphs._cap.size == 328


def test_a_replayed_step_fails_after_free_or_the_next_replay() -> None:
    """A replay's per-example state lives in the graph's static buffers: after ``free`` (``StepContext.publish``)
    or the next batch's replay, they would serve that batch's gradients under this one's norms (1.87× the norm
    in the audit). Used then, it fails, as the eager ``LayerGrads`` does after ``free``."""
    oracle, params, x, y = _setup()
    graphs = graphed.Graphs(oracle._run_ghost, oracle.model)
    w = torch.ones(13)
    first = graphs(params, x, y)
    assert first is not None
    first.weighted_sum(w)
    first.free()
    with pytest.raises(RuntimeError, match="free"):
        first.weighted_sum(w)
    second = graphs(params, x * 100.0, y)
    assert second is not None and bool((second.norms > 0).all())
    assert second.weighted_sum(w).wide and second.grads  # its own replay: served
    graphs(params, x, y)
    for use in (lambda: second.weighted_sum(w), lambda: second.grads):
        with pytest.raises(RuntimeError, match="another batch's replay"):
            use()
