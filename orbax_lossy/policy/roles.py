"""Leaf roles from the training framework's structure, else from key names.

A leaf's role decides its default codec. :func:`leaf_roles` reads the *objects* of a tree
(before flattening), :func:`path_roles` only the key paths (what a policy sees when the
caller passes no roles). The rule, for a floating-point leaf, first match wins:

1. inside a Flax NNX ``Variable``: ``Param`` (and subclasses) -> ``param``; an optimizer
   variable (``nnx.training.optimizer.OptState``: ``OptArray``, ``OptVariable``) -> by field
   name (step 5); any other variable (``BatchStat``, ``Cache``, ``Intermediate``, user
   variables) -> ``state``;
2. inside an Optax state (a NamedTuple defined in ``optax``): the field it sits in:
   ``mu``/``trace``/``momentum``/``m`` -> ``first_moment``; ``nu``/``v``/``nu_max``/
   ``sum_of_squares`` -> ``second_moment``; any other field (``ema``, ``acc_grads``,
   hyper-parameters) -> ``optimizer``;
3. inside a ``flax.training.train_state.TrainState`` (or any object with ``params`` and
   ``opt_state`` attributes): the ``params`` field -> ``param``; ``opt_state`` -> step 5;
   any other field (``batch_stats``, ``ema_params``, ``dynamic_scale``, metrics) -> ``state``;
4. key names (:func:`~orbax_lossy.policy.base.leaf_role`): under ``opt_state``/``optimizer``/
   ``opt``, or a ``mu``/``nu``/``trace``/``momentum`` key -> that optimizer role;
5. a ``params`` key on its path (linen's ``params`` collection, a ``TrainState.params``
   field) -> ``param``;
6. otherwise ``state`` if the tree *marks its parameters* (some leaf is an NNX ``Param``,
   under a TrainState's ``params`` or under a ``params`` key), else ``param``: a tree that
   says nothing about which leaves are trained (``{"w": ..., "b": ...}``, or
   ``{"w": ..., "opt": adam_state}``) keeps every such float leaf a parameter.

Integer, bool and complex leaves are ``nonfloat`` and typed PRNG keys ``rng`` whatever their
place. ``state`` is stored exactly by the default policies: BatchNorm statistics, a loss
scale, an EMA of the parameters, metrics are not the parameters being trained, and a
``LC(3)`` error that is harmless on a weight update is not harmless on a running variance.

:func:`path_roles` applies steps 4-6 (parameters marked = some path has a ``params`` key), so it
agrees with :func:`leaf_roles` on linen variables, TrainStates and dicts of them, and differs
only where types carry the information (NNX variables, Optax states outside ``opt_state``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from orbax_lossy import dtypes
from orbax_lossy.policy.base import leaf_role
from orbax_lossy.treepaths import StoredPath, encode_path

#: Optax state fields holding a first moment (an EMA of gradients) or a second moment
FIRST_MOMENT_FIELDS = frozenset({"mu", "trace", "momentum", "m"})
SECOND_MOMENT_FIELDS = frozenset({"nu", "v", "nu_max", "sum_of_squares"})
#: the key that marks trainable parameters (linen collection, TrainState field)
PARAMS_KEY = "params"


def _key_name(entry: Any) -> Any:
    if isinstance(entry, DictKey):
        return entry.key
    if isinstance(entry, GetAttrKey):
        return entry.name
    if isinstance(entry, SequenceKey):
        return entry.idx
    return getattr(entry, "key", entry)


def _float_role(dtype: Any) -> str | None:
    """``rng``/``nonfloat`` from the dtype alone, else None (a float leaf)."""
    kind = dtypes.kind(dtype)
    return None if kind == "float" else "rng" if kind == "rng" else "nonfloat"


def optimizer_role_of_field(name: Any) -> str:
    """Role of a leaf under the optimizer-state field ``name``."""
    if name in FIRST_MOMENT_FIELDS:
        return "first_moment"
    if name in SECOND_MOMENT_FIELDS:
        return "second_moment"
    return "optimizer"


def _named_optimizer_role(path: StoredPath) -> str:
    """A leaf known to be optimizer state: its role from the names on its path."""
    keys = {str(k) for _, k in path}
    if keys & SECOND_MOMENT_FIELDS:
        return "second_moment"
    if keys & FIRST_MOMENT_FIELDS:
        return "first_moment"
    return "optimizer"


def _has_params_key(path: StoredPath) -> bool:
    return any(k == PARAMS_KEY for _, k in path)


def path_roles(paths: Sequence[StoredPath], dtypes: Sequence[Any]) -> list[str]:
    """Roles from key paths and dtypes only (steps 4-6 of the module docstring)."""
    structured = any(_has_params_key(p) for p in paths)
    out = []
    for path, dtype in zip(paths, dtypes, strict=True):
        role = leaf_role(path, dtype)
        if role == "param" and structured and not _has_params_key(path):
            role = "state"
        out.append(role)
    return out


# --------------------------------------------------------------------------- typed walk


def _nnx_types() -> tuple[type, type, type] | None:
    """NNX's Variable, Param and OptState, when NNX is in use (a tree holding NNX variables
    means ``flax.nnx`` is imported already; importing it here would cost ~0.6 s inside the
    first ``save()`` of every process that does not use it)."""
    if "flax.nnx" not in sys.modules:
        return None
    try:
        from flax import nnx
        from flax.nnx.training.optimizer import OptState
    except ImportError:  # flax is optional for this module
        return None
    return nnx.Variable, nnx.Param, OptState


def _is_optax_state(node: Any) -> bool:
    cls = type(node)
    return (isinstance(node, tuple) and hasattr(cls, "_fields")
            and cls.__module__.split(".")[0] == "optax")


def _is_train_state(node: Any) -> bool:
    return (not isinstance(node, (dict, list, tuple)) and hasattr(node, PARAMS_KEY)
            and hasattr(node, "opt_state"))


def _children(node: Any, keep_none: bool) -> list[tuple[Any, Any]] | None:
    """``[(key entry, child)]`` one level down, or None if ``node`` is a leaf."""
    entries, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    if jax.tree_util.treedef_is_leaf(treedef) and len(entries) == 1 and not entries[0][0]:
        return None
    return [(p[0], c) for p, c in entries if keep_none or c is not None]


def leaf_roles(item: Any, keep_none: bool = False) -> list[str]:
    """Role of every leaf of ``item``, in the order of
    :func:`orbax_lossy.treepaths.flatten` with the same ``keep_none`` (module docstring).

    Pure and cheap (one walk of the tree's nodes, no device work): the handler may call it
    on the training thread. ``None`` leaves (``keep_none=True``) are ``nonfloat``.
    """
    nnx_types = _nnx_types()
    found: list[tuple[StoredPath, Any, str | None]] = []  # (path, leaf, typed role or None)

    def walk(node: Any, keys: list[Any], ctx: str | None) -> None:
        # ctx: None, "opt" (optimizer state: roles by field names below), or a fixed role
        if node is None:
            found.append((encode_path(keys), None, "nonfloat"))
            return
        if nnx_types is not None and isinstance(node, nnx_types[0]):
            if isinstance(node, nnx_types[2]):
                ctx = "opt"
            elif ctx != "opt":
                ctx = "param" if isinstance(node, nnx_types[1]) else "state"
        children = _children(node, keep_none)
        if children is None:
            found.append((encode_path(keys), node, ctx))
            return
        optax_state = _is_optax_state(node)
        train_state = _is_train_state(node)
        for entry, child in children:
            name = _key_name(entry)
            child_ctx = ctx
            if ctx is None or ctx == "opt":
                if optax_state:
                    child_ctx = optimizer_role_of_field(name)
                elif train_state and ctx is None:
                    child_ctx = ("param" if name == PARAMS_KEY
                                 else "opt" if name == "opt_state" else "state")
            walk(child, [*keys, entry], child_ctx)

    walk(item, [], None)
    structured = any(ctx == "param" or _has_params_key(p) for p, _, ctx in found)
    roles = []
    for path, leaf, ctx in found:
        if leaf is None:
            roles.append("nonfloat")
            continue
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        fixed = _float_role(dtype)
        if fixed is not None:
            roles.append(fixed)
        elif ctx == "opt":
            roles.append(_named_optimizer_role(path))
        elif ctx is not None:
            roles.append(ctx)
        else:
            roles.append(path_roles([path], [dtype])[0] if not structured
                         else _structured_role(path, dtype))
    return roles


def _structured_role(path: StoredPath, dtype: Any) -> str:
    role = leaf_role(path, dtype)
    if role == "param" and not _has_params_key(path):
        return "state"
    return role
