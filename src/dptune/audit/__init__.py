"""``dptune.audit``: empirical evidence that the privacy claims hold.

``run_audit(strategy, eps, delta, method='one-run'|'two-world')`` trains the real strategy code
on canaries and returns an ``AuditResult`` whose ``lower_bound`` holds with probability ≥
``confidence``; one above the claimed ε refutes the claim. ``runner``: what is trained;
``harness``: canaries, the release spy, scores; ``bounds``: the statistics. The broken variants
that show the audits have power are in ``tests/mutants`` (docs/reliability.md).
"""

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
