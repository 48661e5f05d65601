"""dptune: differentially private training and honest hyperparameter tuning."""

from dptune.accounting import calibrate, epsilon, joint_noise_multiplier, oso_q_noise_multiplier
from dptune.deliverable import load_model
from dptune.deliverable import save_trained as save_model
from dptune.errors import BudgetExceededError, ConfigError, DataError, DivergedError, DPTuneError
from dptune.ledger import Ledger
from dptune.loop import PrivateTraining, make_private
from dptune.own import Metric, from_dataloader
from dptune.strategies import STRATEGIES, chain, make_strategy
from dptune.train import RunPlan, TrainResult, plan_run, train

__version__ = "0.1.0"

__all__ = [
    "train", "save_model", "load_model", "plan_run", "RunPlan", "TrainResult", "calibrate", "epsilon", "joint_noise_multiplier",
    "oso_q_noise_multiplier", "Ledger", "make_strategy", "STRATEGIES", "ConfigError", "DataError",
    "BudgetExceededError", "DivergedError", "DPTuneError", "Metric", "from_dataloader", "make_private",
    "PrivateTraining", "chain",
]
