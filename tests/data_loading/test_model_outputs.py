"""What a model of yours may return to a loss of yours: a tensor, a tuple or dict of tensors, a Hugging Face
``ModelOutput`` (its cache dropped: a batched forward's cache holds every example). Anything else is one clear
error naming the fix, not ``None`` handed to your loss (found in review, session 13)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptune
from dptune import ConfigError
from dptune.inputs import tmap

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor


class Returns(nn.Module):
    def __init__(self, wrap: type) -> None:
        super().__init__()
        self.lin, self.wrap = nn.Linear(4, 2), wrap

    def forward(self, x: torch.Tensor) -> object:
        return self.wrap(self.lin(x))


def _train(model: nn.Module) -> dptune.TrainResult:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    loss = lambda out, y: F.cross_entropy(out.logits if isinstance(out, Out) else out[0], y, reduction="none")  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dptune.train(model, (x, (x[:, 0] > 0).long()), "dpsgd", steps=2, expected_batch_size=10,
                            noise_multiplier=1.0, loss=loss)  # fmt: skip


def test_a_plain_dataclass_output_is_one_error_naming_the_fix() -> None:
    """Found in review: each non-tensor leaf became None, so the loss got None for the whole output and failed with
    "'NoneType' object has no attribute 'logits'", which read as a bug of yours."""
    with pytest.raises(ConfigError, match="holds a value of type Out.*Fix: return a tensor, a tuple or dict"):
        _train(Returns(Out))
    res = _train(Returns(lambda t: (t, None)))  # a tuple (None in it) trains
    assert res.ledger.releases == 2


def test_only_a_cache_among_a_model_outputs_leaves_is_dropped() -> None:
    class DynamicCache:  # a cache by name, as Hugging Face's ``Cache`` subclasses
        pass

    t = torch.ones(3, 2)
    kept = tmap(lambda v: v[:1], {"logits": t, "past_key_values": DynamicCache(), "aux": None})
    assert kept["logits"].shape == (1, 2) and kept["past_key_values"] is None and kept["aux"] is None
    with pytest.raises(ConfigError, match="holds a value of type int"):
        tmap(lambda v: v, (t, 3))
