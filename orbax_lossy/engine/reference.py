"""The reference: the reconstruction of the last saved or restored checkpoint.

A delta is encoded against the reference, never against the true previous state, so decode
errors do not accumulate along a chain (LC-Checkpoint's closed loop). This module holds the
reference and decides, per save, whether it can be used (a delta) or not (a base).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.errors import ChainError
from orbax_lossy.format.manifest import MANIFEST_NAME
from orbax_lossy.format.steps import root_key, root_of
from orbax_lossy.treepaths import StoredPath

Signature = tuple[tuple[tuple[int, ...], str] | None, ...]


@dataclasses.dataclass(frozen=True)
class Reference:
    """What the next delta is encoded against.

    ``values`` holds, per leaf, the reconstruction a restore of this step returns (a device
    array, or a host numpy array with ``reference_on_host``), or None for leaves that are
    always stored whole (host leaves, PRNG keys, non-float leaves are still held when on
    device).
    """

    item_dir: str  # final (committed) path of the item directory
    step: int | None
    save_id: str | None
    chain_length: int
    paths: tuple[StoredPath, ...]
    signature: Signature
    values: list[Any]


def delta_signature(on_device: bool, shape: Any, dtype: Any) -> tuple | None:
    """What must not change between a reference and the next save for a delta to be taken.

    Only float device leaves can be delta-coded; the others are always stored whole, so a
    step counter that turns from a Python int into a jax.Array does not force a new base.
    """
    if on_device and jnp.issubdtype(dtype, jnp.floating):
        return (tuple(int(d) for d in shape), np.dtype(dtype).name)
    return None


def usable_reference(
    ref: Reference | None,
    item_dir: str,
    paths: Sequence[StoredPath],
    signature: Signature,
    *,
    force_base: bool,
    base_interval: int,
) -> Reference | None:
    """``ref`` if this save can be a delta against it, else None (a base)."""
    if force_base or ref is None or base_interval <= 1:
        return None
    if ref.paths != tuple(paths) or ref.signature != signature:
        return None
    if ref.chain_length + 1 >= base_interval:
        return None
    if root_of(ref.item_dir) != root_of(item_dir) or ref.item_dir == item_dir:
        return None
    # The reference must have been committed (a failed save leaves no manifest).
    if not os.path.exists(os.path.join(ref.item_dir, MANIFEST_NAME)):
        return None
    return ref


def agree_across_processes(
    ref: Reference | None, held: Reference | None, primary_host: int
) -> Reference | None:
    """Multi-process: every process follows the primary host's base/delta decision.

    :func:`usable_reference` also looks for the reference's manifest on disk. On a shared
    filesystem without cross-host read-after-write consistency, one process may see it and
    another not; they would then run different encode programs (mismatched collectives) and
    write a base and a delta into one step. The in-memory checks are identical everywhere.
    """
    from jax.experimental import multihost_utils

    use = multihost_utils.broadcast_one_to_all(
        np.int32(ref is not None), is_source=jax.process_index() == primary_host
    )
    if not int(use):
        return None
    if ref is None and held is None:
        raise ChainError("the primary host saves a delta but this process has no reference")
    return ref if ref is not None else held


class ProtectedRoots:
    """Checkpoint roots whose retention keeps every step a kept delta needs.

    Orbax's own retention (``max_to_keep``, ``LatestN``, ...) deletes steps that later deltas
    depend on. Deltas are therefore taken only under roots a
    :class:`~orbax_lossy.ChainPreservationPolicy` protects; elsewhere every save is a base,
    and a warning says once per root how to enable chains.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._protected: set[str] = set()
        self._warned: set[str] = set()

    def protect(self, root: os.PathLike | str) -> None:
        """Mark ``root`` as protected."""
        with self._lock:
            self._protected.add(root_key(root))

    def protected(self, root: os.PathLike | str) -> bool:
        """Whether ``root`` is protected."""
        with self._lock:
            return root_key(root) in self._protected

    def warn_once(self, root: os.PathLike | str) -> None:
        """Say (once per root) that saves under ``root`` are bases, and how to change it."""
        key = root_key(root)
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(
            f"orbax_lossy: {key} is not managed by a ChainPreservationPolicy, so Orbax's "
            "retention could delete steps that delta checkpoints depend on; every save there is "
            "a self-contained base. To enable delta chains, build the manager with "
            "ol.checkpoint_manager(directory, ...) (extra items: items={...}), or wrap its "
            "preservation policy in ol.ChainPreservationPolicy(inner, handler, directory), or "
            "pass LossyCheckpointHandler(unmanaged_deltas=True) if nothing deletes old steps.",
            UserWarning,
            stacklevel=4,
        )
