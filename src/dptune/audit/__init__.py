"""``dptune.audit``: empirical evidence that the privacy claims hold.

``run_audit(strategy, eps, delta, method='one-run'|'two-world')`` trains the real strategy code
on canaries and returns an ``AuditResult`` whose ``lower_bound`` is an ε that the observed
membership inference proves, with probability ≥ ``confidence``; a lower bound above the
claimed ε refutes the claim. See ``runner`` (what is trained, threat models), ``harness``
(canaries, the release spy, scores) and ``bounds`` (Steinke et al. 2023 one-run bound,
Clopper–Pearson two-world bound). The deliberately broken variants that show these audits
have power live in ``tests/mutants``; docs/reliability.md has the table.
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
