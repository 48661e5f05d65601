"""``dptune.audit``: empirical evidence that the privacy claims hold. ``run_audit`` trains the real
strategy on canaries and returns an ``AuditResult`` whose ``lower_bound`` holds with probability ≥
``confidence``. Broken variants showing the audits' power: ``tests/mutants`` (docs/reliability.md)."""

from dptune.audit.bounds import (
    clopper_pearson_upper,
    dp_epsilon_from_rates,
    one_run_bound,
    one_run_epsilon,
    one_run_p_value,
    two_world_bound,
)
from dptune.audit.runner import AUDITABLE, SCENARIOS, AuditResult, Scenario, run_audit

__all__ = [
    "run_audit",
    "AuditResult",
    "AUDITABLE",
    "SCENARIOS",
    "Scenario",
    "one_run_bound",
    "one_run_epsilon",
    "one_run_p_value",
    "two_world_bound",
    "clopper_pearson_upper",
    "dp_epsilon_from_rates",
]
