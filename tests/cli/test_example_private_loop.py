"""Issue 11, example (b): examples/private_step_in_your_loop.py — a private step inside a
hand-written loop (torch Adam + cosine schedule, OSO's online C), on the embedded digits data."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_example


def _example():
    return load_example("private_step_in_your_loop.py")


def test_hand_written_loop_spends_the_budget_learns_c_and_saves(tmp_path: Path) -> None:
    out = _example().main(epochs=3.0, epsilon=3.0, save=tmp_path / "m", verbose=False)
    assert out["releases"] == out["steps"] and out["epsilon"] == pytest.approx(3.0, rel=1e-3)
    assert out["clips"][0] == 0.5 and out["clips"][-1] != 0.5  # C moved from released values only
    assert out["test_accuracy"] > 0.3  # 10 classes: well above chance after ~34 steps
    assert out["reloaded_accuracy"] == pytest.approx(out["test_accuracy"], abs=1e-9)
    assert out["card"]["guarantee"]["epsilon"] == pytest.approx(out["epsilon"])
    assert out["card"]["configuration"]["strategy"]["description"] == "torch.optim.adam.Adam"
