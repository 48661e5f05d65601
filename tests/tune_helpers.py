"""Tiny studies shared by the tests: one parametrised builder (``make_study``) on small seeded
data (``linear_data``, ``planning_data``), the tuner's executor/budget grid (``tiny_dpsgd_study``),
a study file on the embedded digits data (the CLI edge, store-safety, fuzz and crash tests) and a
study file on the user's own data and model (tests/own_factories.py); ``panda_final_mu`` (Panda's
final-run μ, checked against the paper's worked example); ``study_lock``, a coordinator's lock alone."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from dptune import accounting
from dptune.errors import ConfigError
from dptune.tune import BudgetSpec, MethodSpec, SelectionSpec, StrategyArm, Study, TrainingSpec

Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def linear_data(seed: int = 0, n: int = 360, dim: int = 8, n_train: int = 270, *, uniform: bool = False) -> Data:
    """(x, y, x_test, y_test): ``n`` seeded rows (standard normal, or uniform in [-1, 1]) labelled
    by the argmax of a random linear map to 3 classes; the first ``n_train`` rows train."""
    g = torch.Generator().manual_seed(seed)
    if uniform:
        x = torch.rand(n, dim, generator=g) * 2 - 1
        y = (x @ torch.rand(dim, 3, generator=g)).argmax(1)
    else:
        x = torch.randn(n, dim, generator=g)
        y = (x @ torch.randn(dim, 3, generator=g)).argmax(1)
    return (x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def planning_data(seed: int = 0) -> Data:
    """20 rows of 4 features with coin-flip labels, the same rows as train and test: for studies
    that are only planned (the planners read the data's size, not its values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 4, generator=g)
    return (x, torch.randint(0, 2, (20,), generator=g), x, torch.randint(0, 2, (20,), generator=g))


def make_study(
    data: Any = None,
    *,
    arms: Sequence[StrategyArm] | None = None,
    strategy: str = "dpsgd",
    space: Mapping[str, Any] | None = None,
    fixed: Mapping[str, Any] | None = None,
    model: Any = "logistic_regression",
    training: TrainingSpec | None = None,
    eps: float | Sequence[float] = 2.0,
    delta: float = 1e-5,
    accountant: str = "rdp",
    account_seeds: bool = False,
    method: str = "grid",
    opts: Mapping[str, Any] | None = None,
    selection: SelectionSpec | None = None,
    seeds: Sequence[int] = (0,),
    name: str = "study",
    **fields: Any,
) -> Study:
    """A study for the tests; every part can be overridden. By default: one DP-SGD arm (``strategy``
    with ``space``, lr 0.5, and ``fixed``) of logistic regression on ``linear_data()``, 10 steps of
    batch 40, ε = 2 (one value or several), δ = 1e-5, RDP, a grid, default selection, seed 0.
    ``arms`` replaces the single arm; ``fields`` are further ``Study`` fields (trials_per_group,
    secure, seed, ...)."""
    if arms is None:
        arms = (
            StrategyArm(strategy, space=dict(space) if space is not None else {"lr": [0.5]}, fixed=dict(fixed or {})),
        )
    return Study(
        data=data if data is not None else linear_data(),
        model=model,
        strategies=tuple(arms),
        training=training or TrainingSpec(steps=10, expected_batch_size=40),
        budget=BudgetSpec(
            epsilon=tuple(eps) if isinstance(eps, Sequence) else (eps,),
            delta=delta,
            accountant=accountant,
            account_seeds=account_seeds,
        ),
        method=MethodSpec(method, dict(opts or {})),
        selection=selection or SelectionSpec(),
        seeds=tuple(seeds),
        name=name,
        **fields,
    )


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
    **fields: Any,
) -> Study:
    """The executor/budget tests' grid: DP-SGD (clip 1) over ``lrs`` on ``linear_data``; ``fields``
    are further ``Study`` fields."""
    return make_study(
        linear_data(data_seed, n, dim, n_train),
        space={"lr": list(lrs)},
        fixed={"clip": 1.0},
        training=TrainingSpec(steps=steps, expected_batch_size=batch),
        eps=eps,
        account_seeds=account_seeds,
        selection=selection,
        seeds=seeds,
        name=name,
        **fields,
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


def panda_final_mu(total_eps: float, delta: float, sweeps: Sequence[tuple[int, float]]) -> float:
    """μ_f left for the final run: √(μ_total² − Σ count·μ_i²), μ_total from (ε, δ)."""
    mu_t = accounting.gdp_mu_for_epsilon(total_eps, delta)
    rest = mu_t**2 - sum(c * accounting.gdp_mu_for_epsilon(e, delta) ** 2 for c, e in sweeps)
    if rest <= 0:
        raise ConfigError(
            f"linear-scaling: the sweeps alone exceed ε = {total_eps}; lower sweep_epsilons or runs_per_sweep."
        )
    return math.sqrt(rest)


@contextmanager
def study_lock(study_dir: Any) -> Iterator[None]:
    """One coordinator per study directory (``study._StudyClaim`` without the undo), as another process holds it."""
    from dptune.tune.study import _StudyClaim

    with _StudyClaim(study_dir) as claim:
        claim.started = True
        yield
