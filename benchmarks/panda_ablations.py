"""Two of Panda et al.'s (ICML 2024) appendix ablations, small and on the CPU (about a minute):

    python benchmarks/panda_ablations.py

* iterate averaging (§A.5, Fig. 11): full-batch DP-GD (``dpgd``, default η by linear scaling)
  returning the last iterate, the EMA (decay 1 − 10/T) or the SWA (mean of the last half) of its
  iterates, on digits (sklearn 8×8, MLP 64-64-10), ε ∈ {1, 3}, T ∈ {25, 100}, δ = 1e-5;
* DP-ZO (§A.4, Table 14): ``dpzo`` on digits with a logistic regression, ε = 3, T = 500,
  L = 256, at its default η (linear scaling, r/(C·T)) against a grid of η, and DP-SGD's default.

Test accuracy of the final parameters, mean over seeds. The runs are not accounted together:
this compares algorithms, it is not an honest tuning.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import dptune
import dptune.data as dpdata


def _digits() -> tuple[torch.Tensor, ...]:
    ds = dpdata.load("digits")
    flat = [t.reshape(t.shape[0], -1).float() for t in (ds.x_train, ds.x_test)]
    return flat[0], ds.y_train, flat[1], ds.y_test


def _final_accuracy(r: dptune.TrainResult) -> float:
    return [e for e in r.evals if e["step"] == r.plan.steps][-1]["accuracy"]


def averaging(seeds: tuple[int, ...] = (0, 1, 2)) -> None:
    x, y, xt, yt = _digits()

    def mlp(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(x.shape[1], 64), nn.Tanh(), nn.Linear(64, 10))

    print("DP-GD iterate averaging (digits MLP): test accuracy, last iterate / EMA / SWA")
    for eps in (1.0, 3.0):
        for T in (25, 100):
            acc = {}
            for avg in ("none", "ema", "swa"):
                runs = [
                    dptune.train(mlp(s), (x, y), "dpgd", steps=T, full_batch=True, target_epsilon=eps, delta=1e-5,
                                 seed=s, device="cpu", eval_data=(xt, yt), eval_every=T, average=avg)
                    for s in seeds
                ]  # fmt: skip
                acc[avg] = statistics.fmean(_final_accuracy(r) for r in runs)
            print(f"  ε = {eps:g}, T = {T:3d}: " + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()), flush=True)


def dpzo(seeds: tuple[int, ...] = (0, 1)) -> None:
    x, y, xt, yt = _digits()

    def logreg(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Linear(x.shape[1], 10)

    print("DP-ZO (digits logistic regression, ε = 3, T = 500, L = 256): test accuracy")
    for name, lr in [("dpzo", None), *(("dpzo", v) for v in (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)), ("dpsgd", None)]:
        runs = [
            dptune.train(logreg(s), (x, y), name, steps=500, expected_batch_size=256, target_epsilon=3.0, delta=1e-5,
                         seed=s, device="cpu", eval_data=(xt, yt), eval_every=500, lr=lr)
            for s in seeds
        ]  # fmt: skip
        lab = "default" if lr is None else f"η = {lr:g}"
        print(f"  {name:5s} {lab:10s} {statistics.fmean(_final_accuracy(r) for r in runs):.3f}", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    averaging()
    dpzo()
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
