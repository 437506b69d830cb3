"""Policies: which codec each leaf gets on each save.

``base`` declares what the handler reads (:class:`Policy`) and the role names; ``roles``
gives every leaf its role (framework types, else names); ``static``
holds the rule-based :class:`LeafPolicy`; ``adaptive`` the statistics-driven
:class:`AdaptivePolicy`.
"""

from orbax_lossy.policy.adaptive import AdaptivePolicy
from orbax_lossy.policy.base import EXACT_ROLES, ROLES, Policy, leaf_role
from orbax_lossy.policy.roles import leaf_roles, path_roles
from orbax_lossy.policy.static import (
    DEFAULT_BASE_CODECS,
    DEFAULT_ROLE_CODECS,
    PARAMS_ONLY_CODECS,
    LeafPolicy,
)

__all__ = [
    "DEFAULT_BASE_CODECS",
    "DEFAULT_ROLE_CODECS",
    "PARAMS_ONLY_CODECS",
    "EXACT_ROLES",
    "ROLES",
    "AdaptivePolicy",
    "LeafPolicy",
    "Policy",
    "leaf_role",
    "leaf_roles",
    "path_roles",
]
