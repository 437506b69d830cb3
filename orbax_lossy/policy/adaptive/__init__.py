"""The adaptive policy: device statistics, pricing of any codec, and the choice rule."""

from orbax_lossy.policy.adaptive.pricing import Candidate, choose, price
from orbax_lossy.policy.adaptive.rule import (
    DEFAULT_BUDGETS,
    DEFAULT_PROGRESS_BUDGETS,
    AdaptivePolicy,
    default_candidates,
)
from orbax_lossy.policy.adaptive.statistics import leaf_statistics

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_PROGRESS_BUDGETS",
    "AdaptivePolicy",
    "Candidate",
    "choose",
    "default_candidates",
    "leaf_statistics",
    "price",
]
