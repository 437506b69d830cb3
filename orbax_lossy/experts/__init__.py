"""Partial Experts Checkpoint (PEC) for Mixture-of-Experts training.

See ``docs/partial_experts.md``.
"""

from orbax_lossy.experts.partial import PartialExperts, PreparedSave
from orbax_lossy.experts.report import partial_experts_report
from orbax_lossy.experts.rules import rules_from_nnx, rules_from_shardings

__all__ = [
    "PartialExperts",
    "PreparedSave",
    "partial_experts_report",
    "rules_from_nnx",
    "rules_from_shardings",
]
