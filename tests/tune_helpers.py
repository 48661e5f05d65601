"""Tiny dpsgd grid studies shared by the tests: on seeded random data (the tuner's executor/budget
tests), as a study file on the embedded digits data (the CLI edge, store-safety, fuzz and crash
tests) and as a study file on the user's own data and model (tests/own_factories.py)."""

from __future__ import annotations

from collections.abc import Sequence

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


def tiny_study_toml(
    name: str, steps: int = 10, seeds: Sequence[int] = (0,), lrs: Sequence[float] = (0.5,), selection: str = ""
) -> str:
    """A DP-SGD grid on digits (logistic regression, batch 64, ε = 2, RDP) as a study file: by default
    one run; ``selection`` is an optional [selection] table."""
    return f"""
[study]
name = "{name}"
seeds = {list(seeds)}

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
{selection}
[[strategies]]
name = "dpsgd"
space = {{ lr = {list(lrs)} }}
fixed = {{ clip = 1.0 }}
"""


def own_factories_study_toml(name: str, model: str = "own_factories:make_model") -> str:
    """A private-selection DP-SGD grid (two learning rates, one seed) on tests/own_factories.py's data
    with the model factory ``model``, as a study file."""
    return f"""
[study]
name = "{name}"
seeds = [0]
[data]
factory = "own_factories:load_data"
options = {{ n = 160, n_test = 60 }}
[model]
factory = "{model}"
options = {{ hidden = 6 }}
[training]
steps = 10
expected_batch_size = 30
[budget]
epsilon = [2.0]
delta = 1e-5
[selection]
mode = "private"
eval_every = 5
noise_multiplier = 20.0
[method]
name = "grid"
[[strategies]]
name = "dpsgd"
space = {{ lr = [0.3, 1.0] }}
fixed = {{ clip = 1.0 }}
"""
