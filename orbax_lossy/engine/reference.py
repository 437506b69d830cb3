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
import numpy as np

from orbax_lossy import dtypes
from orbax_lossy.errors import ChainError
from orbax_lossy.format.manifest import MANIFEST_NAME
from orbax_lossy.format.steps import exists, root_key, root_of, step_of
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
    if on_device and dtypes.kind(dtype) == "float":
        return (tuple(int(d) for d in shape), dtypes.name(dtype))
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
    if not exists(os.path.join(ref.item_dir, MANIFEST_NAME)):
        return None
    return ref


def choose_reference(
    held: Reference | None,
    item_dir: str,
    paths: Sequence[StoredPath],
    signature: Signature,
    *,
    force_base: bool,
    base_interval: int,
    roots: ProtectedRoots,
    unmanaged: bool,
    primary_host: int,
) -> Reference | None:
    """The reference this save is a delta against, or None for a base (agreed by all
    processes; only under a root whose retention keeps chains, unless ``unmanaged``)."""
    ref = usable_reference(held, item_dir, paths, signature, force_base=force_base,
                           base_interval=base_interval)
    if ref is not None and not (unmanaged or roots.protected(root_of(item_dir))):
        roots.warn_once(root_of(item_dir))
        ref = None
    if jax.process_count() > 1:
        ref = agree_across_processes(ref, held, primary_host)
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


class ReferenceStore:
    """A handler's references (one chain per item name), saves in flight, and dependencies.

    A save publishes its reconstruction from the commit thread; everything that reads a
    reference (the next save of the item, a restore, tests) first waits for that.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._references: dict[str, Reference] = {}
        self._pending: dict[str, threading.Event] = {}
        self._dependencies: dict[tuple[str, int], dict[str, set[int]]] = {}
        self.last_item: str | None = None

    def wait(self, item: str | None) -> None:
        """Block until the save in flight for ``item`` (if any) has published."""
        pending = self._pending.get(item) if item is not None else None
        if pending is not None:
            pending.wait()

    def get(self, item: str | None, wait: bool = True) -> Reference | None:
        """The reference of ``item`` (after its save in flight, unless ``wait=False``)."""
        if wait:
            self.wait(item)
        return None if item is None else self._references.get(item)

    def begin(self, item: str) -> threading.Event:
        """Mark a save of ``item`` in flight; set the returned event once it has published."""
        event = self._pending[item] = threading.Event()
        self.last_item = item
        return event

    def put(self, ref: Reference) -> None:
        """Make ``ref`` the reference of its item."""
        name = os.path.basename(ref.item_dir)
        self._references[name] = ref
        self.last_item = name

    def drop(self, item: str) -> None:
        """Forget ``item``'s reference (a failed save: the next one is a base)."""
        self._references.pop(item, None)

    def clear(self) -> None:
        """Forget every reference."""
        self._references.clear()

    def record_dependencies(self, item_dir: str, steps: set[int]) -> None:
        """Remember which steps the save (or restore) of ``item_dir`` depends on."""
        step = step_of(item_dir)
        if step is not None:
            with self._lock:
                items = self._dependencies.setdefault((root_key(root_of(item_dir)), step), {})
                items[os.path.basename(item_dir)] = set(steps)

    def dependencies_of(self, root: str, step: int) -> dict[str, set[int]]:
        """Per item saved under ``root`` at ``step``, the steps it needs (KeyError: unknown)."""
        with self._lock:
            return {k: set(v) for k, v in self._dependencies[(root_key(root), step)].items()}


def restored_reference(restored: Any, on_host: bool) -> Reference:
    """The reference a complete restore leaves (copies the handler owns)."""
    from orbax_lossy.engine.device import copy_tree

    # a copy, not zero-copy views as save() holds: a view makes the runtime refuse the
    # donation of the restored state, so a train step that donates it would copy it at once,
    # in the step (256 MB: restore plus a donating step 661-717 ms with views, 590-593 ms
    # with this asynchronous copy; docs/performance.md)
    leaves = restored.manifest.leaves
    values = copy_tree([v if leaf.storage == "device" else None
                        for v, leaf in zip(restored.values, leaves, strict=True)])
    if on_host:
        values = [np.asarray(v) if v is not None else None for v in values]
    signature = tuple(
        delta_signature(leaf.storage == "device" and not leaf.key_impl, leaf.shape, leaf.dtype)
        for leaf in leaves
    )
    header = restored.manifest.header
    return Reference(restored.item_dir, header.step, header.save_id, header.chain_length,
                     tuple(leaf.path for leaf in leaves), signature, values)
