"""Orbax's per-leaf save and restore arguments, translated for the lossy pipelines.

``LossySave(item, save_args)`` and ``LossyRestore(item, restore_args, ...)`` accept the trees
Orbax's standard args take (``ocp.SaveArgs``, ``ocp.RestoreArgs``, ``ocp.ArrayRestoreArgs``,
e.g. from Flax's ``save_args_from_target`` / ``restore_args_from_target``) with Orbax's
meaning, and refuse what the lossy format cannot honour with an error that says why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.treepaths import encode_path, flatten, path_str


@dataclasses.dataclass(frozen=True)
class LeafTarget:
    """What a restore argument asks of one leaf (any field may be None: as saved)."""

    shape: tuple[int, ...] | None = None
    dtype: Any = None
    sharding: jax.sharding.Sharding | None = None
    as_numpy: bool = False


def _is_args(x: Any) -> bool:
    return isinstance(x, (ocp.SaveArgs, ocp.RestoreArgs))


def _by_path(tree: Any) -> dict:
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_args)[0]
    return {encode_path(p): leaf for p, leaf in leaves_with_path}


def apply_save_args(item: Any, save_args: Any) -> Any:
    """``item`` with each leaf cast to its ``SaveArgs.dtype`` (Orbax casts on write)."""
    args = _by_path(save_args)
    paths, leaves, treedef = flatten(item)
    out = []
    for path, leaf in zip(paths, leaves, strict=True):
        sa = args.get(path)
        if sa is None:
            out.append(leaf)
            continue
        if not isinstance(sa, ocp.SaveArgs):
            raise InvalidArgumentError(
                f"save_args for leaf {path_str(path)!r} is {type(sa).__name__}, not ocp.SaveArgs"
            )
        if sa.chunk_byte_size is not None or tuple(sa.shard_axes or ()):
            raise InvalidArgumentError(
                f"leaf {path_str(path)!r}: SaveArgs.chunk_byte_size / shard_axes choose "
                "TensorStore chunks; the lossy format has its own chunk grid (set "
                "LossyCheckpointHandler(chunk_bytes=...) instead)"
            )
        if sa.dtype is not None and hasattr(leaf, "astype"):
            leaf = leaf.astype(sa.dtype)
        out.append(leaf)
    unknown = set(args) - set(paths)
    if unknown:
        raise InvalidArgumentError(
            f"save_args names leaves the item does not have: {sorted(map(path_str, unknown))[:5]}"
        )
    return jax.tree_util.tree_unflatten(treedef, out)


def _leaf_target(ra: Any, where: str) -> LeafTarget:
    if not isinstance(ra, ocp.RestoreArgs):
        raise InvalidArgumentError(f"restore_args for {where} is {type(ra).__name__}, not "
                                   "ocp.RestoreArgs / ocp.ArrayRestoreArgs")
    as_numpy = ra.restore_type is np.ndarray
    if not isinstance(ra, ocp.ArrayRestoreArgs):
        return LeafTarget(dtype=ra.dtype, as_numpy=as_numpy)
    sharding = ra.sharding
    if sharding is None and ra.mesh is not None:
        spec = ra.mesh_axes if ra.mesh_axes is not None else jax.sharding.PartitionSpec()
        sharding = jax.sharding.NamedSharding(ra.mesh, spec)
    if isinstance(sharding, ocp.metadata.ShardingMetadata):
        sharding = sharding.to_jax_sharding()
    shape = ra.global_shape if ra.global_shape is not None else ra.shape
    return LeafTarget(None if shape is None else tuple(shape), ra.dtype, sharding, as_numpy)


def merge_restore_args(item: Any, restore_args: Any) -> Any:
    """The target tree a restore goes onto: ``item``'s leaves, refined by ``restore_args``."""
    if restore_args is None:
        return item
    args = _by_path(restore_args)
    if item is None:
        return jax.tree_util.tree_map(lambda ra: _leaf_target(ra, "a leaf"), restore_args,
                                      is_leaf=_is_args)
    paths, leaves, treedef = flatten(item)
    out = []
    for path, leaf in zip(paths, leaves, strict=True):
        ra = args.get(path)
        if ra is None or leaf is ocp.PLACEHOLDER:
            out.append(leaf)
            continue
        spec = _leaf_target(ra, repr(path_str(path)))
        shape = getattr(leaf, "shape", None)
        out.append(LeafTarget(
            shape=spec.shape if spec.shape is not None else
            (tuple(shape) if shape is not None else None),
            dtype=spec.dtype if spec.dtype is not None else getattr(leaf, "dtype", None),
            sharding=spec.sharding if spec.sharding is not None else
            getattr(leaf, "sharding", None),
            as_numpy=spec.as_numpy or isinstance(leaf, np.ndarray),
        ))
    return jax.tree_util.tree_unflatten(treedef, out)
