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

from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.treepaths import StoredPath, flatten, path_str


def _classify_leaf(path: StoredPath, leaf: Any) -> str:
    """Storage kind of a leaf: ``device`` (jax.Array), ``numpy`` or a Python scalar type."""
    if isinstance(leaf, jax.Array):
        return "device"
    if isinstance(leaf, (bool, np.bool_)):
        return "bool"
    if isinstance(leaf, (int, np.integer)) and not isinstance(leaf, bool):
        return "int"
    if isinstance(leaf, (float, np.floating)):
        return "float"
    if isinstance(leaf, np.ndarray):
        return "numpy"
    raise InvalidArgumentError(
        f"leaf {path_str(path)!r} has unsupported type {type(leaf).__name__}; orbax_lossy "
        "saves jax.Array, numpy arrays and Python/numpy scalars"
    )


def validate_item(item: Any) -> tuple[list[StoredPath], list[Any], list[str]]:
    """Flatten and check a tree to save; raises :class:`InvalidArgumentError` naming the leaf."""
    if item is None:
        raise InvalidArgumentError("LossySave needs an item to save, got None")
    paths, leaves, _ = flatten(item)
    if not leaves:
        raise InvalidArgumentError("LossySave item has no leaves")
    kinds = []
    for path, leaf in zip(paths, leaves, strict=True):
        kind = _classify_leaf(path, leaf)
        if kind == "device":
            if leaf.is_deleted():
                raise InvalidArgumentError(f"leaf {path_str(path)!r} is a deleted (donated) array")
            if jax.process_count() > 1 and leaf.is_fully_addressable:
                if not leaf.sharding.is_fully_replicated:
                    raise InvalidArgumentError(
                        f"leaf {path_str(path)!r} is a process-local array in a multi-process "
                        "run; make it a global jax.Array (jax.make_array_from_process_local_data)"
                    )
                kind = "numpy"  # a process-local replicated value: the primary writes it
        elif kind == "numpy" and leaf.dtype == object:
            raise InvalidArgumentError(f"leaf {path_str(path)!r} is an object array")
        kinds.append(kind)
    return paths, leaves, kinds


@dataclasses.dataclass
class LossySave(ocp.args.CheckpointArgs):
    """Save ``item`` (any pytree of arrays and scalars) through the lossy handler.

    ``force_base=True`` writes a full lossless snapshot regardless of the base interval.
    The tree is validated here, before Orbax starts the save.
    """

    item: Any
    force_base: bool = False

    def __post_init__(self) -> None:
        validate_item(self.item)


@dataclasses.dataclass
class LossyRestore(ocp.args.CheckpointArgs):
    """Restore a checkpoint. Every field is optional.

    ``item``: a target tree (arrays, ``jax.ShapeDtypeStruct`` with ``sharding``, or the saved
    state itself) whose structure, dtypes and shardings the result takes; leaves present on
    disk but absent from ``item`` are skipped. Without it, nested dicts are returned, device
    leaves on the first local device (single process) or replicated (multi-process).
    """

    item: Any = None
