"""Tiny dpsgd grid studies shared by the tests: on seeded random data (the tuner's executor/budget
tests) and as a study file on the embedded digits data (the CLI edge, store-safety and fuzz tests)."""

from __future__ import annotations

import torch

from dptune.tune import BudgetSpec, MethodSpec, SelectionSpec, StrategyArm, Study, TrainingSpec


def tiny_dpsgd_study(
    *,
    data_seed: int,
    n: int,
    dim: int,
    n_train: int,
    lrs: list[float],
    steps: int,
    batch: int,
    eps: float,
    selection: SelectionSpec,
    seeds: tuple[int, ...],
    name: str,
    account_seeds: bool = False,
) -> Study:
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(n, dim, generator=g)
    y = (x @ torch.randn(dim, 3, generator=g)).argmax(1)
    return Study(
        data=(x[:n_train], y[:n_train], x[n_train:], y[n_train:]),
        model="logistic_regression",
        strategies=(StrategyArm("dpsgd", space={"lr": list(lrs)}, fixed={"clip": 1.0}),),
        training=TrainingSpec(steps=steps, expected_batch_size=batch),
        budget=BudgetSpec(epsilon=(eps,), delta=1e-5, accountant="rdp", account_seeds=account_seeds),
        method=MethodSpec("grid"),
        selection=selection,
        seeds=seeds,
        name=name,
    )


def tiny_study_toml(name: str, steps: int = 10) -> str:
    """A one-run DP-SGD grid on digits (logistic regression, batch 64, ε = 2, RDP) as a study file."""
    return f"""
[study]
name = "{name}"
seeds = [0]

[data]
name = "digits"
options = {{ flatten = true }}

[model]
name = "logistic_regression"

[training]
steps = {steps}
expected_batch_size = 64

[budget]
epsilon = 2.0
delta = 1e-5
accountant = "rdp"

[method]
name = "grid"

[[strategies]]
name = "dpsgd"
space = {{ lr = [0.5] }}
fixed = {{ clip = 1.0 }}
"""
