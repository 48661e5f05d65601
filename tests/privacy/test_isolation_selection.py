"""One example, one score: a privately released selection score depends on its example alone.

The tuner's private selection releases Σ_i clamp(score_i, 0, c) + noise with sensitivity c. A
batched forward (or metric) that mixes rows — batch statistics in eval mode — lets one added
example move every other score, so the sum moves by far more than c (docs/privacy.md, the unit
of privacy). ``metrics.score_sums(..., clip=True)`` computes each score from its row alone.
"""

from __future__ import annotations

import torch

from dptune import metrics


class BatchCentred(torch.nn.Module):
    """Predicts class 1 when a feature is above the batch mean: mixes rows in every mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x - x.mean(0, keepdim=True)
        return torch.cat([-z, z], dim=1)


class PerRow(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x, x], dim=1)


def _sums(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, metric=metrics.ACCURACY) -> float:
    (total,), _ = metrics.score_sums(model, (x, y), metric, clip=True)
    return total


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.linspace(1.0, 2.0, 40).reshape(-1, 1)
    y = torch.ones(40, dtype=torch.long)
    outlier = torch.tensor([[1000.0]])
    return x, y, outlier


def test_batch_statistics_cannot_move_a_private_score_sum_by_more_than_c() -> None:
    x, y, outlier = _data()
    model = BatchCentred()
    without = _sums(model, x, y)
    with_one = _sums(model, torch.cat([x, outlier]), torch.cat([y, torch.ones(1, dtype=torch.long)]))
    # Batched, the outlier moves the mean above every other row: 20 correct -> 1 correct.
    assert abs(with_one - without) <= 1.0


def test_a_mixing_metric_cannot_move_a_private_score_sum_by_more_than_c() -> None:
    def relative(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return out[:, 1] / out[:, 1].abs().mean()  # normalised by the batch

    metric = metrics.Metric(relative, higher_is_better=True, sensitivity=1.0, name="relative")
    x, y, outlier = _data()
    model = PerRow()
    without = _sums(model, x, y, metric)
    with_one = _sums(model, torch.cat([x, outlier]), torch.cat([y, torch.ones(1, dtype=torch.long)]), metric)
    assert abs(with_one - without) <= 1.0 + 1e-6


def test_isolated_scores_equal_batched_scores_for_a_per_row_model() -> None:
    # The control: a model that does not mix gets the same sum as the batched evaluation.
    x, y, _ = _data()
    y = (x.reshape(-1) > 1.5).long()
    model = PerRow()
    (batched,), _ = metrics.score_sums(model, (x - 1.5, y), metrics.ACCURACY, clip=False)
    assert _sums(model, x - 1.5, y) == batched


def test_models_vmap_cannot_run_are_scored_row_by_row() -> None:
    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if float(x.sum()) > 0:  # data-dependent control flow: vmap refuses it
                return torch.cat([-x, x], dim=1)
            return torch.cat([x, -x], dim=1)

    x, y, outlier = _data()
    assert _sums(DataDependent(), x, y) == 40.0
