"""Your own data, loss and metric with ``dptune.train`` (issue 11, item 2).

A map-style dataset read by index, a ``TensorDataset``, a ``DataLoader``'s dataset and the
in-memory tensor pair give the same run for the same seed (bit for bit on CPU), empty
Poisson batches included; user losses and metrics follow a per-example contract checked early.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dptune
from dptune import ConfigError, Metric
from dptune.own import MapSource, materialize

N = 200


pytestmark = pytest.mark.usefixtures("one_thread")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 5, generator=g)
    return x, (x @ torch.randn(5, 3, generator=g)).argmax(1)


class ByIndex(Dataset):
    """Reads one example per ``__getitem__`` (and counts the reads): nothing is batched in memory."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y, self.reads = x.clone(), y.clone(), 0

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.x[i], self.y[i]


def _model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _run(data, eval_data=None, batch: float = 20.0, steps: int = 25, **kw) -> dptune.TrainResult:
    return dptune.train(
        _model(),
        data,
        "dpsgd",
        steps=steps,
        expected_batch_size=batch,
        noise_multiplier=1.0,
        lr=0.5,
        clip=1.0,
        seed=3,
        device="cpu",
        eval_data=eval_data,
        eval_every=5,
        **kw,
    )


def _same(a: dptune.TrainResult, b: dptune.TrainResult) -> None:
    assert a.final_params.keys() == b.final_params.keys()
    for k in a.final_params:
        assert torch.equal(a.final_params[k], b.final_params[k]), k
    assert [r["batch_size"] for r in a.history] == [r["batch_size"] for r in b.history]
    assert a.evals == b.evals


def test_map_dataset_matches_tensor_pair_bit_for_bit():
    x, y = _data()
    ds = ByIndex(x, y)
    pair = _run((x, y), eval_data=(x, y))
    mapped = _run(ds, eval_data=ds)
    _same(pair, mapped)
    assert ds.reads > 0  # the batches really came through __getitem__
    assert pair.evals and pair.best_metric == mapped.best_metric


def test_empty_poisson_batches_work_on_a_map_dataset():
    x, y = _data()
    # q = 1/200 per example: P(empty batch) = (1 - q)^200 ≈ 0.37, so 30 steps have empty ones.
    pair, mapped = _run((x, y), batch=1.0, steps=30), _run(ByIndex(x, y), batch=1.0, steps=30)
    sizes = [r["batch_size"] for r in mapped.history]
    assert 0 in sizes and any(s > 0 for s in sizes)
    _same(pair, mapped)
    empty = MapSource(ByIndex(x, y), torch.device("cpu")).batch(torch.zeros(0, dtype=torch.long))
    assert empty[0].shape == (0, 5) and empty[1].shape == (0,) and empty[1].dtype == y.dtype


def test_tensor_dataset_takes_the_fast_path_and_matches():
    x, y = _data()
    _same(_run((x, y), eval_data=(x, y)), _run(TensorDataset(x, y), eval_data=TensorDataset(x, y)))
    assert torch.equal(materialize(ByIndex(x, y))[0], x)


def test_dataloader_dataset_replaces_its_sampler_by_poisson():
    x, y = _data()
    loader = DataLoader(ByIndex(x, y), batch_size=7, shuffle=True, drop_last=True)
    pair = _run((x, y))
    _same(pair, _run(dptune.from_dataloader(loader)))
    with pytest.warns(UserWarning, match="Poisson"):
        direct = _run(loader)  # accepted too, with a warning naming what is ignored
    _same(pair, direct)
    # The realised batch sizes vary (Poisson), unlike the loader's fixed 7.
    assert len({r["batch_size"] for r in direct.history}) > 1


def test_dataloader_custom_collate_is_kept():
    x, y = _data()
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])

    res = _run(dptune.from_dataloader(DataLoader(ByIndex(x, y), batch_size=4, collate_fn=collate)))
    _same(_run((x, y)), res)
    assert seen


def test_user_loss_per_example_matches_builtin():
    x, y = _data()
    builtin = _run((x, y))
    user = _run(ByIndex(x, y), loss=lambda out, t: F.cross_entropy(out, t, reduction="none"))
    for k in builtin.final_params:
        torch.testing.assert_close(builtin.final_params[k], user.final_params[k], rtol=1e-5, atol=1e-6)
    # A different loss really changes the run (the callable is used, not ignored).
    other = _run((x, y), loss=lambda out, t: 2.0 * F.cross_entropy(out, t, reduction="none"))
    assert not torch.equal(other.final_params["0.weight"], builtin.final_params["0.weight"])


def test_user_loss_with_a_reduced_output_is_a_clear_error():
    x, y = _data()
    with pytest.raises(ConfigError, match=r"one value per example.*reduction='none'"):
        _run((x, y), loss=lambda out, t: F.cross_entropy(out, t))


def test_user_metric_public_evaluation_and_direction():
    x, y = _data()
    acc = _run((x, y), eval_data=(x, y))
    mine = _run(
        (x, y), eval_data=ByIndex(x, y), metric=Metric(lambda out, t: (out.argmax(1) == t).double(), name="my_accuracy")
    )
    assert mine.metric == "my_accuracy"
    assert [e["my_accuracy"] for e in mine.evals] == pytest.approx([e["accuracy"] for e in acc.evals])
    err = _run(
        (x, y),
        eval_data=(x, y),
        metric=Metric(lambda out, t: (out.argmax(1) != t).double(), higher_is_better=False, name="error"),
    )
    assert err.best_metric == pytest.approx(1 - acc.best_metric)  # lower is better: the best is the minimum
    assert err.best_step == acc.best_step


def test_user_metric_must_be_per_example():
    x, y = _data()
    with pytest.raises(ConfigError, match="one score per example"):
        _run((x, y), eval_data=(x, y), metric=Metric(lambda out, t: (out.argmax(1) == t).double().mean()))


def test_private_release_of_a_metric_needs_its_sensitivity():
    m = Metric(lambda out, t: (out - t).abs().reshape(-1), higher_is_better=False)
    with pytest.raises(ConfigError, match="states no sensitivity"):
        m.require_sensitivity()
    with pytest.raises(ConfigError, match="sensitivity"):
        Metric(lambda o, t: o, sensitivity=-1.0)
    bounded = Metric(lambda out, t: (out - t).abs().reshape(-1), higher_is_better=False, sensitivity=2.0)
    out = torch.tensor([[0.5], [10.0], [float("nan")]])
    # Clamped to [0, s]; a non-finite score counts as the worst (s, lower is better).
    assert bounded.scores(out, torch.zeros(3, 1), clip=True).tolist() == [0.5, 2.0, 2.0]


def test_inputs_that_are_not_tensors_are_refused_with_a_clear_error():
    """Several tensor inputs are supported (tests/gradients/test_multi_input.py); raw strings are not."""
    x, y = _data()

    class RawText(Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return f"example {i}", y[i]

    with pytest.raises(ConfigError, match="tuple of tensors"):
        _run(RawText())


def test_unsupported_data_is_a_clear_error():
    with pytest.raises(ConfigError, match="map-style dataset"):
        _run(object())


def test_a_dict_is_not_a_dataset_and_train_many_needs_a_loss_name() -> None:
    """A dict has __len__ and __getitem__ but is keyed, not indexed: one clear error, no KeyError.
    ``train_many`` stacks built-in losses only: a callable is refused with the fix."""
    import dptune
    from dptune.errors import ConfigError
    from dptune.vectorized import train_many

    x = torch.randn(40, 4)
    y = (x[:, 0] > 0).long()
    with pytest.raises(ConfigError, match="map-style dataset"):
        dptune.train(
            torch.nn.Linear(4, 2),
            {"x": x, "y": y},
            "dpsgd",
            epochs=1,
            expected_batch_size=8,
            noise_multiplier=1.0,
            lr=0.1,
        )
    with pytest.raises(ConfigError, match="built-in loss name"):
        train_many(
            lambda s: torch.nn.Linear(4, 2),
            (x, y),
            "dpsgd",
            configs=[{"lr": 0.1}] * 2,
            noise_multiplier=1.0,
            epochs=1,
            expected_batch_size=8,
            loss=lambda o, t: (o - t).sum(1),
        )


class _ReusedBuffer(Dataset):
    """A ``__getitem__`` that fills one preallocated output and returns it (a common speed trick)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, numpy: bool = False) -> None:
        self.x, self.y = x, y
        self.buf = x[0].clone().numpy() if numpy else x[0].clone()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.buf[:] = self.x[i].numpy() if not torch.is_tensor(self.buf) else self.x[i]
        return self.buf, self.y[i]


@pytest.mark.parametrize("numpy", [False, True], ids=["tensor", "ndarray"])
def test_a_dataset_reusing_one_output_buffer_gives_each_example_its_own_row(numpy: bool) -> None:
    """Found in review: every item was read before any was stacked, so a reused buffer made each row of a batch
    the batch's last example (one example moved the released sum by 18.4·C; a study's copy held one example)."""
    torch.manual_seed(0)
    x, y = torch.randn(50, 4), torch.randint(0, 2, (50,))
    ds = _ReusedBuffer(x, y, numpy)
    bx, by = MapSource(ds, torch.device("cpu")).batch(torch.tensor([3, 7, 11, 40]))
    assert torch.equal(bx, x[[3, 7, 11, 40]]) and torch.equal(by, y[[3, 7, 11, 40]])
    mx, my = materialize(ds)
    assert torch.equal(mx, x) and torch.equal(my, y)


def test_a_study_keeps_the_dataloaders_collate_and_iterable_or_short_datasets_are_one_error() -> None:
    """Found in review: ``materialize`` (a study's copy) dropped a DataLoader's collate_fn (features x/255 in
    train, raw in a study); an IterableDataset with __len__ and a len() beyond the readable rows gave tracebacks."""
    x, y = torch.rand(30, 3) * 255, torch.randint(0, 2, (30,))

    def scaled(items: list) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*items, strict=True)
        return torch.stack(xs) / 255, torch.stack(ys)

    mx, _ = materialize(dptune.from_dataloader(DataLoader(TensorDataset(x, y), collate_fn=scaled)))
    assert torch.allclose(mx, x / 255)

    class Sized(torch.utils.data.IterableDataset):
        def __len__(self) -> int:
            return 10

        def __iter__(self):
            return iter([(torch.zeros(3), 0)] * 10)

    with pytest.raises(ConfigError):
        dptune.train(nn.Linear(3, 2), Sized(), "dpsgd", steps=1, expected_batch_size=2)

    class Short(TensorDataset):
        def __len__(self) -> int:
            return 60  # 30 readable

    with pytest.raises(ConfigError, match="make len\\(\\) the number of examples"):
        MapSource(Short(x, y), torch.device("cpu")).batch(torch.tensor([1, 45]))


def test_items_whose_x_and_y_are_one_tensor_are_read_once_and_sparse_items_work() -> None:
    """Found in review of the buffer fix: an autoencoder's ``(X[i], X[i])`` counted as a shared buffer (every
    batch read twice), and a sparse tensor (no data pointer) raised."""
    x = torch.randn(10, 4)
    reads = []

    class AutoEncoding(Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int):
            reads.append(i)
            return x[i], x[i]

    bx, by = MapSource(AutoEncoding(), torch.device("cpu")).batch(torch.arange(10))
    assert torch.equal(bx, x) and torch.equal(by, x) and len(reads) == 11  # one read at set-up, one per row

    class Sparse(Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int):
            return x[i].to_sparse(), 0

    def dense(items: list) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*items, strict=True)
        return torch.stack([t.to_dense() for t in xs]), torch.tensor(ys)

    assert torch.equal(MapSource(Sparse(), torch.device("cpu"), dense).batch(torch.arange(10))[0], x)
