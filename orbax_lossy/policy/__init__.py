"""Policies: which codec each leaf gets on each save.

``base`` declares what the handler reads (:class:`Policy`) and the leaf roles; ``static``
holds the rule-based :class:`LeafPolicy`; ``adaptive`` the statistics-driven
:class:`AdaptivePolicy`.
"""

from orbax_lossy.policy.adaptive import AdaptivePolicy
from orbax_lossy.policy.base import EXACT_ROLES, ROLES, Policy, leaf_role
from orbax_lossy.policy.static import DEFAULT_ROLE_CODECS, LeafPolicy

__all__ = [
    "DEFAULT_ROLE_CODECS",
    "EXACT_ROLES",
    "ROLES",
    "AdaptivePolicy",
    "LeafPolicy",
    "Policy",
    "leaf_role",
]
