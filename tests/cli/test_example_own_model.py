"""Issue 11, example (a): examples/own_model_and_data.py runs on small data — your own module and
map-style Dataset through ``dptune.train``, the selected model saved with its card and reloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_example


def _example():
    return load_example("own_model_and_data.py")


def test_example_trains_saves_and_reloads_the_selected_model(tmp_path: Path) -> None:
    ex = _example()
    out = ex.main(n=300, steps=12, epsilon=2.0, out=tmp_path / "m")
    assert out["epsilon"] == pytest.approx(2.0, rel=1e-3) and out["checkpoint"] == {"rule": "final", "step": 12}
    # the reloaded weights are the final parameters (the evaluation data is private: no selection on it)
    assert out["reloaded_accuracy"] == pytest.approx(out["final_accuracy (not DP: for the data owner only)"], abs=1e-6)
    card = json.loads((tmp_path / "m" / "model_card.json").read_text())
    assert card["guarantee"]["delta"] == 1e-5 and card["evaluation_data"] == "private"
    assert card["ledger"]["digest"] == out["ledger_digest"]
    # the dataset really is map-style only (no tensors to take a shortcut through)
    ds = ex.Blobs(5)
    assert not isinstance(ds, torch.utils.data.TensorDataset) and torch.equal(ds[3][0], ds[3][0])
