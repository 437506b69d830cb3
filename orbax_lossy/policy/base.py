"""What the handler needs from a policy, and the role of every leaf.

Every leaf gets a *role* from its key path and dtype:

* ``rng`` - a typed PRNG key array; ``nonfloat`` - integer, bool and complex leaves (step
  counters, token counts); these two are always stored exactly;
* ``second_moment`` - Adam/AdamW ``nu`` (or ``v`` under an optimizer state);
  ``first_moment`` - Adam ``mu``, SGD momentum ``trace`` (or ``m`` under an optimizer
  state); ``optimizer`` - any other float leaf under an optimizer state;
* ``param`` - every other floating-point leaf, unless the tree is structured;
* ``state`` - float leaves that are neither trainable parameters nor optimizer moments
  (BatchNorm statistics, a loss scale, an EMA of the parameters, metrics): stored exactly by
  default. Only :mod:`~orbax_lossy.policy.roles` gives this role (from framework types and
  collections: :func:`~orbax_lossy.policy.roles.leaf_roles`, or from paths alone:
  :func:`~orbax_lossy.policy.roles.path_roles`); :func:`leaf_role` sees one path and cannot.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy import dtypes
from orbax_lossy.codecs.base import Codec
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.treepaths import StoredPath

ROLES = ("param", "first_moment", "second_moment", "optimizer", "state", "nonfloat", "rng")
#: roles whose leaves are always stored exactly, whatever the rules say
EXACT_ROLES = ("nonfloat", "rng")
#: roles of optimizer-state leaves
OPTIMIZER_ROLES = ("first_moment", "second_moment", "optimizer")
#: old role names still accepted in rules and budgets (with a DeprecationWarning)
DEPRECATED_ROLES = {"integer": "nonfloat"}

_OPTIMIZER_KEYS = {"opt_state", "optimizer", "opt"}
_FIRST_MOMENT_KEYS = {"mu", "trace", "momentum", "m"}
_SECOND_MOMENT_KEYS = {"nu", "v"}


def leaf_role(path: StoredPath, dtype: np.dtype | jnp.dtype) -> str:
    """Role of a leaf from its key path and dtype (see the module docstring)."""
    kind = dtypes.kind(dtype)
    if kind == "rng":
        return "rng"
    if kind != "float":  # integers, bool, complex: stored exactly
        return "nonfloat"
    keys = [str(k) for _, k in path]
    in_optimizer = any(k in _OPTIMIZER_KEYS for k in keys)
    if "nu" in keys or (in_optimizer and any(k in _SECOND_MOMENT_KEYS for k in keys)):
        return "second_moment"
    if any(k in ("mu", "trace", "momentum") for k in keys) or (
        in_optimizer and any(k in _FIRST_MOMENT_KEYS for k in keys)
    ):
        return "first_moment"
    if in_optimizer:
        return "optimizer"
    return "param"


def check_role(role: str, where: str) -> str:
    """``role`` if it is a role name (old names mapped, with a warning), else an error."""
    if role in DEPRECATED_ROLES:
        new = DEPRECATED_ROLES[role]
        warnings.warn(f"{where}: role {role!r} is now called {new!r}", DeprecationWarning,
                      stacklevel=3)
        return new
    if role not in ROLES:
        raise InvalidArgumentError(f"{where}: unknown role {role!r}; roles: {ROLES}")
    return role


class Policy(Protocol):
    """What the handler reads from a policy: one codec per device leaf, per save."""

    def plan(
        self,
        paths: Sequence[StoredPath],
        values: Sequence[jax.Array],
        references: Sequence[jax.Array | None],
        is_base: bool,
        roles: Sequence[str] | None = None,
    ) -> list[Codec]:
        """Codec of every device leaf for one save.

        ``references`` holds the previous reconstruction of each leaf (None on base saves).
        ``roles``: the role of every leaf from the tree's objects
        (:func:`~orbax_lossy.policy.roles.leaf_roles`, restricted to these leaves); None:
        from the paths (:func:`~orbax_lossy.policy.roles.path_roles`).
        A policy must return the same plan on every process for the same inputs, and must not
        give a codec that ``needs_reference`` to a leaf without a reference.
        """
        ...
