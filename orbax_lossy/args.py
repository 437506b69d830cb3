"""``LossySave`` / ``LossyRestore``: the ``CheckpointArgs`` of the lossy handler.

``LossySave`` validates the tree when it is constructed, i.e. before Orbax starts a save: an
exception inside ``async_save`` would leave the manager marked as saving forever.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from orbax_lossy import dtypes
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.treepaths import StoredPath, flatten, path_str

#: Python ints are stored as int64 (or uint64 above 2**63 - 1): the range a commit can write
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
#: a ``None`` node is stored as an empty uint8 array of storage ``"none"`` (no payload)
NONE_PLACEHOLDER_DTYPE = np.uint8


def _unsupported(path: StoredPath, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"leaf {path_str(path)!r} {what}; orbax_lossy saves jax.Arrays and numpy arrays of "
        "numeric or bool dtypes, numpy scalars, Python bool/int (-2**63 <= x < 2**64)/float "
        "and None"
    )


def _classify_leaf(path: StoredPath, leaf: Any) -> str:
    """Storage kind of a leaf: ``device`` (jax.Array), ``numpy``, ``scalar`` (numpy scalar),
    ``none`` or a Python scalar type (``int``, ``float``, ``bool``).

    Refuses here what the commit thread could not write, naming the leaf.
    """
    if leaf is None:
        return "none"
    if isinstance(leaf, jax.Array):
        if dtypes.kind(leaf.dtype) != "rng" and not dtypes.writable(leaf.dtype):
            raise _unsupported(path, f"has unsupported dtype {leaf.dtype}")
        return "device"
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        if not INT_MIN <= leaf <= INT_MAX:
            raise _unsupported(path, f"is the Python int {leaf}, outside the 64-bit range")
        return "int"
    if isinstance(leaf, float):
        return "float"
    if isinstance(leaf, np.generic):
        if not dtypes.writable(leaf.dtype):
            raise _unsupported(path, f"is a numpy scalar of unsupported dtype {leaf.dtype}")
        return "scalar"
    if isinstance(leaf, np.ndarray):
        if leaf.dtype == object:
            raise _unsupported(path, "is an object array")
        if not dtypes.writable(leaf.dtype):
            raise _unsupported(path, f"is a numpy array of unsupported dtype {leaf.dtype}")
        return "numpy"
    raise _unsupported(path, f"has unsupported type {type(leaf).__name__}")


def validate_item(item: Any) -> tuple[list[StoredPath], list[Any], list[str]]:
    """Flatten and check a tree to save; raises :class:`InvalidArgumentError` naming the leaf.

    Returns the leaves to write: ``None`` nodes become an empty placeholder array of storage
    ``"none"`` (restored as ``None``).
    """
    if item is None:
        raise InvalidArgumentError("LossySave needs an item to save, got None")
    paths, leaves, _ = flatten(item, keep_none=True)
    if all(leaf is None for leaf in leaves):
        raise InvalidArgumentError("LossySave item has no leaves")
    kinds, out = [], []
    several_processes = None  # asked at the first device leaf: it starts JAX's backends
    for path, leaf in zip(paths, leaves, strict=True):
        kind = _classify_leaf(path, leaf)
        if kind == "none":
            leaf = np.zeros((0,), NONE_PLACEHOLDER_DTYPE)
        elif kind == "device":
            if leaf.is_deleted():
                raise InvalidArgumentError(f"leaf {path_str(path)!r} is a deleted (donated) array")
            if several_processes is None:
                several_processes = jax.process_count() > 1
            if several_processes and leaf.is_fully_addressable:
                if not leaf.sharding.is_fully_replicated:
                    raise InvalidArgumentError(
                        f"leaf {path_str(path)!r} is a process-local array in a multi-process "
                        "run; make it a global jax.Array (jax.make_array_from_process_local_data)"
                    )
                kind = "numpy"  # a process-local replicated value: the primary writes it
        kinds.append(kind)
        out.append(leaf)
    return paths, out, kinds


@dataclasses.dataclass
class LossySave(ocp.args.CheckpointArgs):
    """Save ``item`` (any pytree of arrays and scalars) through the lossy handler.

    ``save_args``: Orbax's per-leaf ``ocp.SaveArgs`` tree (e.g. Flax's
    ``save_args_from_target``); ``dtype`` casts the leaf before it is saved, as in Orbax.
    ``force_base=True`` makes this step a base (no reference: every leaf is coded by the
    policy's codec for base saves, e.g. ``Cluster(8)`` for parameters under the default
    policy) whatever the base interval; with partial experts it saves every expert.
    The tree is validated here, before Orbax starts the save.
    """

    item: Any
    save_args: Any = None
    force_base: bool = False
    #: partial experts (``checkpoint_manager(partial_experts=...)``): tokens routed to each
    #: expert since the previous save, per group (``{"blocks/0/moe": int [E] or [L, E]}``)
    expert_tokens: Any = None
    custom_metadata: Any = None

    def __post_init__(self) -> None:
        if self.custom_metadata is not None:
            raise InvalidArgumentError(
                "LossySave(custom_metadata=...) is not stored by the lossy handler; pass it to "
                "CheckpointManager.save(step, ..., custom_metadata=...) (read back with "
                "mngr.metadata(step).custom_metadata)"
            )
        if self.save_args is not None:
            from orbax_lossy.engine.targets import apply_save_args

            self.item = apply_save_args(self.item, self.save_args)
        validate_item(self.item)
        if self.expert_tokens is not None:
            from orbax_lossy.experts.accounting import validate_tokens

            self.expert_tokens = validate_tokens(self.expert_tokens)


@dataclasses.dataclass
class LossyRestore(ocp.args.CheckpointArgs):
    """Restore a checkpoint; every field is optional and means what it means in Orbax.

    ``item``: a target tree (arrays, ``jax.ShapeDtypeStruct`` with ``sharding``, numpy
    arrays, or the saved state itself) whose structure, dtypes and shardings the result takes;
    ``ocp.PLACEHOLDER`` leaves are skipped. ``restore_args``: Orbax's per-leaf
    ``ocp.RestoreArgs`` / ``ocp.ArrayRestoreArgs`` (sharding, dtype, ``restore_type``), e.g.
    from Flax's ``restore_args_from_target``. ``partial_restore=True`` allows a target that
    holds only some of the stored leaves (without it that is an error, as in Orbax). Without
    ``item``, nested dicts are returned with the saved shardings where their devices exist.
    ``transforms`` / ``legacy_transform_fn`` (tree surgery during restore) and
    ``support_layout`` are not supported and raise :class:`InvalidArgumentError`.
    """

    item: Any = None
    restore_args: Any = None
    partial_restore: bool = False
    strict: bool = True
    fallback_sharding: Any = None
    transforms: Any = None
    transforms_default_to_original: bool = True
    legacy_transform_fn: Any = None
    support_layout: bool = False

    def __post_init__(self) -> None:
        if self.transforms is not None or self.legacy_transform_fn is not None:
            raise InvalidArgumentError(
                "LossyRestore(transforms=...) is not supported: the lossy restore does not "
                "rewrite trees; restore the stored tree (a subset with partial_restore=True) "
                "and transform it in Python"
            )
        if self.support_layout:
            raise InvalidArgumentError(
                "LossyRestore(support_layout=True) is not supported: the lossy format stores "
                "no device memory layouts"
            )

    def target(self) -> Any:
        """The tree the restore goes onto (``item`` refined by ``restore_args``)."""
        from orbax_lossy.engine.targets import merge_restore_args

        return merge_restore_args(self.item, self.restore_args)


def wrong_args(args: Any, expected: str) -> InvalidArgumentError:
    """The error for Orbax's (or any other) args reaching the lossy handler."""
    return InvalidArgumentError(
        f"the lossy handler takes ol.{expected}(...), got {type(args).__name__} (same fields: "
        f"item, save_args / restore_args, ...). To save an item with plain Orbax beside the "
        "lossy one, name it: ol.checkpoint_manager(dir, items={'extra': "
        "ocp.handlers.StandardCheckpointHandler()}) and save ocp.args.Composite(state="
        "ol.LossySave(...), extra=ocp.args.StandardSave(...))"
    )


def check_handler_settings(base_interval: Any, chunk_bytes: int, reference_on_host: bool) -> None:
    """Refuse ``LossyCheckpointHandler`` settings it cannot honour."""
    if not isinstance(base_interval, int) or base_interval < 1:
        raise InvalidArgumentError(f"base_interval must be an int >= 1, got {base_interval!r}")
    if chunk_bytes < 1024:
        raise InvalidArgumentError(f"chunk_bytes must be >= 1024, got {chunk_bytes}")
    if reference_on_host and jax.process_count() > 1:
        raise InvalidArgumentError("reference_on_host is only supported in one process")
