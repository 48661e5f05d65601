"""Galli, Palamidessi & Cucinotta (AAAI 2024), "Online Sensitivity Optimization in
Differentially Private Learning": Online (OSO-DPSGD) vs FixedThreshold (DP-SGD) vs
FixedQuantile (Andrew et al.) vs AdamWOSM vs NoDP, with per-grid privacy budgets.

Paper settings (main text, "Experiments", and appendix Tables 5–13):

* ranges C ∈ [10⁻², 10²], ρ (learning rate) ∈ [10^−2.5, 10^1.5], k ∈ {5, 7, 9} values
  "uniformly separated in a logarithmic scale" (tables report k = 7); γ ∈ {0.1, 0.3, 0.5,
  0.7, 0.9} (Andrew et al.'s values), η_C = 0.2 and C₀ = 0.1 for FixedQuantile, C₀ = 0.1
  and ρ_c = ρ_r = 2.5·10⁻³ for Online;
* grids: Online searches ρ only ("one hyperparameter fewer"), FixedThreshold ρ × C,
  FixedQuantile ρ × γ, AdamWOSM C only (its step size is the ESS with α = 10⁻³), NoDP ρ;
* budgets per grid, not per run, composed with the moments accountant (RDP); the ε lists
  are those of Figures 3–5 (MNIST and AG News {3, 5, 7, 9}, Fashion-MNIST AE {1, 2, 3, 4});
  δ is not stated in the paper: 10⁻⁵ (< 1/n for every dataset);
* 5 seeds per configuration, *not* accounted, scores averaged over seeds (so
  ``across_seeds = "mean"``); 10 epochs; batch 512 (Table 1); the model is validated on the
  full test set every 50 iterations and the best checkpoint represents the configuration
  (``split = "test"``, public selection, as in the paper).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dptune.presets._common import Part, check_int_option, log_grid, study_dict

GAMMAS = (0.1, 0.3, 0.5, 0.7, 0.9)  # Andrew et al.'s target quantiles, kept by Galli
LR_RANGE = (-2.5, 1.5)  # log10 bounds of ρ
CLIP_RANGE = (-2.0, 2.0)  # log10 bounds of C
PAPER_K = (5, 7, 9)
DELTA = 1e-5

# dataset → (data section, model section, paper ε list, metric)
DATASETS: dict[str, dict[str, Any]] = {
    "mnist": {
        "data": {"name": "mnist"},
        "model": {"name": "galli_cnn"},
        "epsilons": [3.0, 5.0, 7.0, 9.0],
        "title": "MNIST, CNN (Galli Table 5, 551,322 parameters)",
    },
    "fmnist-ae": {
        "data": {"name": "fashion_mnist", "options": {"task": "reconstruction"}},
        "model": {"name": "galli_autoencoder"},
        "epsilons": [1.0, 2.0, 3.0, 4.0],
        "title": "Fashion-MNIST, convolutional autoencoder (Galli Table 6, 48,705 parameters), MSE",
    },
    "agnews": {
        "data": {"name": "ag_news", "options": {"representation": "bow_embedding"}},
        "model": {"name": "galli_bow_fc"},
        "epsilons": [3.0, 5.0, 7.0, 9.0],
        "title": "AG News, bag-of-words embedding + FC network (Galli Table 7)",
    },
}

# Reduced settings. "small": real data, ≤ 60 min on a 2-core CPU (see docs/reproduce.md for the
# measured step times behind these numbers); "smoke": seconds, for CI.
SMALL: dict[str, dict[str, Any]] = {
    "mnist": {"limit": 6000, "batch": 256, "epochs": 3, "eval_every": 25, "seeds": [0],
              "epsilons": [3.0, 9.0], "gammas": [0.3, 0.5, 0.7]},
    "fmnist-ae": {"limit": 2500, "batch": 128, "epochs": 3, "eval_every": 20, "seeds": [0],
                  "epsilons": [2.0, 4.0], "gammas": [0.3, 0.5, 0.7]},
    "agnews": {"limit": None, "batch": 512, "epochs": 10, "eval_every": 50, "seeds": [0, 1, 2],
               "epsilons": [3.0, 5.0, 7.0, 9.0], "gammas": [0.3, 0.5, 0.7]},
}
SMOKE: dict[str, dict[str, Any]] = {
    "mnist": {"limit": 200, "batch": 32, "steps": 4, "eval_every": 2},
    "fmnist-ae": {"limit": 120, "batch": 16, "steps": 3, "eval_every": 2},
    "agnews": {"limit": 300, "batch": 64, "steps": 6, "eval_every": 3},
}


def strategies(k: int, gammas: list[float], *, adamwosm: bool = True, nodp: bool = True) -> list[dict[str, Any]]:
    """Galli's five grids over the k-point log ranges (see the module docstring)."""
    lrs = log_grid(*LR_RANGE, k)
    clips = log_grid(*CLIP_RANGE, k)
    out: list[dict[str, Any]] = [
        # Online: ρ₀ searched, C learned online from C₀ = 0.1 ("one hyperparameter fewer").
        {"name": "oso", "space": {"lr": lrs}, "fixed": {"initial_clip": 0.1, "clip_lr": 2.5e-3, "lr_lr": 2.5e-3},
         "method": {"name": "online"}},
        {"name": "dpsgd", "space": {"lr": lrs, "clip": clips}, "fixed": {"momentum": 0.0}},  # FixedThreshold
        {"name": "quantile", "space": {"lr": lrs, "target_quantile": list(gammas)},
         "fixed": {"clip_lr": 0.2, "initial_clip": 0.1, "momentum": 0.0}},
    ]
    if adamwosm:
        # α = 10⁻³ (Mohapatra et al.'s ESS numerator, which Galli keep: "ρ₀ = 10⁻³").
        out.append({"name": "adamwosm", "space": {"clip": clips}, "fixed": {"alpha": 1e-3}})
    if nodp:
        out.append({"name": "nodp", "space": {"lr": lrs}})
    return out


def build(dataset: str, scale: str, options: Mapping[str, Any]) -> list[Part]:
    spec = DATASETS[dataset]
    data = {"name": spec["data"]["name"], "options": dict(spec["data"].get("options", {}))}
    selection = {"mode": "public", "split": "test", "checkpoint": "best", "across_seeds": "mean"}
    budget = {"delta": DELTA, "accountant": "rdp", "account_seeds": False}
    if scale == "paper":
        k = check_int_option("k", options.get("k", 7), PAPER_K)
        training = {"epochs": 10, "expected_batch_size": 512}
        selection["eval_every"] = 50
        seeds = [0, 1, 2, 3, 4]
        eps = spec["epsilons"]
        gammas = list(GAMMAS)
    elif scale == "small":
        s = SMALL[dataset]
        k = check_int_option("k", options.get("k", 3))
        if s["limit"] is not None:
            data["options"]["limit"] = s["limit"]
        training = {"epochs": s["epochs"], "expected_batch_size": s["batch"]}
        selection["eval_every"] = s["eval_every"]
        seeds, eps, gammas = s["seeds"], s["epsilons"], s["gammas"]
    else:
        s = SMOKE[dataset]
        k = check_int_option("k", options.get("k", 2))
        data["options"]["limit"] = s["limit"]
        training = {"steps": s["steps"], "expected_batch_size": s["batch"]}
        selection["eval_every"] = s["eval_every"]
        seeds, eps, gammas = [0], [spec["epsilons"][-1]], [0.5]
    if not data["options"]:
        del data["options"]
    budget["epsilon"] = list(eps)
    name = f"galli-{dataset}"
    study = study_dict(name=f"{name}-{scale}", data=data, model=spec["model"], training=training, budget=budget,
                       selection=selection, strategies=strategies(k, gammas), seeds=seeds,
                       method={"name": "grid"})
    notes = (f"grid granularity k = {k}; ε ∈ {list(eps)}, δ = {DELTA:g}, per-grid budgets (RDP); "
             f"{len(seeds)} seed(s), not accounted, scores averaged over seeds.",)
    return [Part("study", spec["title"], study, notes)]
