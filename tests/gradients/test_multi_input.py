"""Models with several inputs: a batch x may be a tuple (positional arguments) or a dict (keyword
arguments) of tensors sharing the batch dimension (``dptune.inputs``), in memory or from a
map-style dataset, through ``train``, ``train_many`` and ``make_private``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import dptune
from dptune.errors import ConfigError
from dptune.gradients.oracle import GradientOracle
from dptune.vectorized import train_many


class TwoTower(nn.Module):
    """A dense input and a bag of token ids: forward(dense, ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 8), nn.Embedding(10, 8), nn.Linear(8, 3)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(dense) + self.b(ids).mean(1)))


class Pairs(Dataset):
    """Map-style: item i is ((dense_i, ids_i), y_i) or ({'dense':…, 'ids':…}, y_i)."""

    def __init__(self, dense, ids, y, as_dict: bool) -> None:
        self.dense, self.ids, self.y, self.as_dict = dense, ids, y, as_dict

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x = {"dense": self.dense[i], "ids": self.ids[i]} if self.as_dict else (self.dense[i], self.ids[i])
        return x, self.y[i]


def _data(n: int = 160):
    g = torch.Generator().manual_seed(0)
    dense, ids = torch.randn(n, 4, generator=g), torch.randint(0, 10, (n, 5), generator=g)
    return dense, ids, (dense[:, 0] > 0).long() + (ids[:, 0] > 4).long()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TwoTower()


KW = {
    "steps": 15,
    "expected_batch_size": 40,
    "noise_multiplier": 1.0,
    "seed": 5,
    "device": "cpu",
    "lr": 0.5,
}


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_tuple_dict_and_dataset_inputs_give_the_same_run(method: str) -> None:
    dense, ids, y = _data()
    runs = {
        "tuple": dptune.train(_model(), ((dense, ids), y), "dpsgd", grad_method=method, **KW),
        "dict": dptune.train(_model(), ({"dense": dense, "ids": ids}, y), "dpsgd", grad_method=method, **KW),
        "dataset-tuple": dptune.train(_model(), Pairs(dense, ids, y, False), "dpsgd", grad_method=method, **KW),
        "dataset-dict": dptune.train(_model(), Pairs(dense, ids, y, True), "dpsgd", grad_method=method, **KW),
    }
    ref = runs.pop("tuple")
    assert ref.ledger.releases == 15
    for name, r in runs.items():
        for k, v in ref.final_params.items():
            assert torch.equal(r.final_params[k], v), (name, k)
    moved = any(not torch.equal(ref.final_params[k], p.detach()) for k, p in _model().named_parameters())
    assert moved


def test_ghost_norms_match_vmap_on_a_two_input_model() -> None:
    dense, ids, y = _data(24)
    model = _model()
    params = {k: p.detach() for k, p in model.named_parameters()}
    for x in ((dense, ids), {"dense": dense, "ids": ids}):
        ghost = GradientOracle(model, method="ghost")(params, x, y)
        vmap = GradientOracle(model, method="vmap")(params, x, y)
        torch.testing.assert_close(ghost.norms, vmap.norms, rtol=1e-4, atol=1e-6)
        assert bool((ghost.norms >= vmap.norms * (1 - 1e-6)).all())  # never under the exact norm


def test_several_inputs_with_evaluation_train_many_and_make_private() -> None:
    dense, ids, y = _data()
    x = {"dense": dense, "ids": ids}
    r = dptune.train(_model(), (x, y), "dpsgd", eval_data=(x, y), eval_every=5, **KW)
    assert r.best_metric is not None and 0.0 <= r.best_metric <= 1.0
    with pytest.warns(RuntimeWarning, match="sequentially"):  # a two-input module is not a stackable Sequential
        many = train_many(
            lambda s: _model(),
            (x, y),
            "dpsgd",
            configs=[{"lr": 0.5}, {"lr": 0.1}],
            steps=15,
            expected_batch_size=40,
            noise_multiplier=1.0,
            seeds=[5, 6],
            device="cpu",
        )
    assert all(torch.equal(many[0].final_params[k], r.final_params[k]) for k in r.final_params)
    model = _model()
    private = dptune.make_private(
        model,
        (x, y),
        torch.optim.SGD(model.parameters(), lr=0.5),
        steps=5,
        expected_batch_size=40,
        noise_multiplier=1.0,
        device="cpu",
    )
    for xb, yb in private.batches():
        assert set(xb) == {"dense", "ids"} and xb["dense"].shape[0] == yb.shape[0]
        private.step(xb, yb)
    assert private.ledger.releases == 5


def test_bad_structured_inputs_are_one_clear_error() -> None:
    dense, ids, y = _data()
    with pytest.raises(ConfigError, match="same first \\(batch\\) dimension"):
        dptune.train(_model(), ((dense, ids[:10]), y), "dpsgd", **KW)
    with pytest.raises(ConfigError, match="x and y have different lengths"):
        dptune.train(_model(), ((dense, ids), y[:10]), "dpsgd", **KW)
    with pytest.raises(ConfigError, match="tuple of tensors"):
        dptune.train(_model(), (("a", "b"), y), "dpsgd", **KW)


def test_nested_python_lists_are_still_one_input() -> None:
    """x given as nested lists of numbers is one tensor input (not a tuple of inputs)."""
    dense, ids, y = _data(60)
    model = nn.Linear(4, 3)
    r = dptune.train(model, (dense.tolist(), y.tolist()), "dpsgd", steps=3, expected_batch_size=20,
                     noise_multiplier=1.0, device="cpu")  # fmt: skip
    assert r.ledger.releases == 3


def test_a_study_holds_out_examples_of_several_inputs_by_each_example_alone(tmp_path, monkeypatch) -> None:
    """Studies take several inputs: the holdout hashes every input of an example and nothing else
    (one example's change moves that example only), and the splits keep the inputs together."""
    from dptune.tune.data import holdout_mask, study_data
    from dptune.tune.spec import DataSpec, SelectionSpec

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(200, 3, generator=g), torch.randn(200, 2, generator=g)
    y = (a[:, 0] > 0).long()
    m = holdout_mask((a, b), y, 0.3, 0)
    b2 = b.clone()
    b2[7] += 1.0
    others = torch.arange(200) != 7
    assert torch.equal(m[others], holdout_mask((a, b2), y, 0.3, 0)[others])
    assert not torch.equal(m, holdout_mask(a, y, 0.3, 0))  # the second input is hashed too
    (tmp_path / "two_inputs_data.py").write_text(
        "import torch\n"
        "def load():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    a, b = torch.randn(200, 3, generator=g), torch.randn(200, 2, generator=g)\n"
        "    y = (a[:, 0] > 0).long()\n"
        "    return ((a, b), y), ((a[:10], b[:10]), y[:10])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    d = study_data(
        DataSpec(factory="two_inputs_data:load"), SelectionSpec("private", "holdout", holdout_fraction=0.3), 0
    )
    assert d.n_val == int(m.sum()) and d.n_train == 200 - d.n_val and d.input_shape == (3,)
    assert torch.equal(d.x_val[0], a[m]) and torch.equal(d.x_val[1], b[m]) and torch.equal(d.x_train[1], b[~m])
