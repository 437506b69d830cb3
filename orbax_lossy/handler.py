"""``LossyCheckpointHandler``: the Orbax adapter of the save and restore pipelines.

``async_save`` (training thread): validate -> choose the reference (base or delta) -> copies
the handler owns -> return a commit future that encodes on device, publishes the next
reference, entropy-codes and writes files (:mod:`orbax_lossy.engine.save`). ``finalize``
(primary host) merges the per-process indexes into the manifest. ``restore`` runs
:mod:`orbax_lossy.engine.restore`. See ``docs/format.md`` for the layout on disk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import re
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from orbax_lossy.args import (
    LossyRestore,
    LossySave,
    check_handler_settings,
    validate_item,
    wrong_args,
)
from orbax_lossy.commit import commit_future
from orbax_lossy.engine import restore as restoring
from orbax_lossy.engine import save
from orbax_lossy.engine.reference import (
    ProtectedRoots,
    Reference,
    ReferenceStore,
    choose_reference,
    restored_reference,
)
from orbax_lossy.entropy import warmup
from orbax_lossy.format import lock as writer_lock
from orbax_lossy.format.manifest import DEFAULT_CHUNK_BYTES, read_manifest
from orbax_lossy.format.steps import abspath, final_path
from orbax_lossy.policy import LeafPolicy, Policy
from orbax_lossy.policy.roles import leaf_roles
from orbax_lossy.threads import available_cores
from orbax_lossy.treepaths import empty_nodes

TYPESTR = "orbax_lossy.LossyCheckpointHandler"


class LossyCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Orbax handler for lossy, delta-coded checkpoints of pytrees.

    Args:
      policy: per-leaf codec choice (default :class:`~orbax_lossy.LeafPolicy`: parameters
        and optimizer moments compressed, everything else exact; docs/whole_state.md).
      base_interval: a full lossless base every ``base_interval`` saves; saves in between
        are deltas against the reconstruction of the previous save.
      chunk_bytes: target size of a chunk of the fixed chunk grid (of the raw array).
      reference_on_host: keep the reference in host memory (single-process only).
      primary_host: the process that writes the manifest (as the manager's option).
      encode_threads: threads for entropy coding in the background commit and in restores
        (default: every core this process may run on).
      unmanaged_deltas: take deltas even where no ChainPreservationPolicy keeps the steps they
        depend on (by default such saves are self-contained bases, with a one-time warning;
        see ``docs/retention.md``). Only when nothing deletes old steps.
      partial_experts: an :class:`~orbax_lossy.PartialExperts` (MoE): each save stores all
        non-expert state and K experts per MoE layer (``docs/partial_experts.md``).
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        base_interval: int = 10,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        reference_on_host: bool = False,
        primary_host: int = 0,
        encode_threads: int | None = None,
        unmanaged_deltas: bool = False,
        partial_experts: Any = None,
    ) -> None:
        check_handler_settings(base_interval, chunk_bytes, reference_on_host)
        self.policy: Policy = policy or LeafPolicy()
        self.base_interval = base_interval
        self.chunk_bytes = int(chunk_bytes)
        self.reference_on_host = reference_on_host
        self.primary_host = primary_host
        self.encode_threads = encode_threads or available_cores()
        self.unmanaged_deltas = bool(unmanaged_deltas)
        self.partial_experts = partial_experts  # hooks: prepare_save, publish, restore
        self._roots = ProtectedRoots()
        self._store = ReferenceStore()  # one chain per item name
        self.last_restore_bytes_read = 0
        self._last_save_stats: dict[str, Any] = {}
        warmup.start()  # numba's kernels load while the job builds its state

    @classmethod
    def typestr(cls) -> str:
        """Stable name persisted by Orbax (so moving modules never breaks checkpoints)."""
        return TYPESTR

    @property
    def reference(self) -> Reference | None:
        """The reference of the item saved or restored last (see :meth:`reference_for`)."""
        return self._store.get(self._store.last_item)

    def reference_for(self, item_name: str) -> Reference | None:
        """What the next delta of item ``item_name`` is encoded against."""
        return self._store.get(item_name)

    def dependencies_of(self, root: str, step: int) -> dict[str, set[int]]:
        """Per item saved under ``root`` at ``step``, the steps it needs (KeyError: unknown)."""
        return self._store.dependencies_of(root, step)

    def protect_chains(self, root: os.PathLike | str) -> None:
        """Allow deltas under ``root``: its retention keeps every step a kept step needs.

        :class:`~orbax_lossy.ChainPreservationPolicy` calls this for its manager's directory.
        """
        self._roots.protect(root)

    def chains_protected(self, root: os.PathLike | str) -> bool:
        """Whether deltas may be taken under ``root`` (see ``unmanaged_deltas``)."""
        return self.unmanaged_deltas or self._roots.protected(root)

    def reset_reference(self) -> None:
        """Forget every reference: the next save of each item is a full base."""
        self._store.clear()

    def close(self) -> None:
        """Release this handler's writer locks (Orbax calls it from ``CheckpointManager.close``)."""
        writer_lock.release(self)
        super().close()


    async def async_save(
        self, directory: epath.Path, args: LossySave
    ) -> list[ocp.future.Future] | None:
        """Secure handler-owned copies and return the commit future that encodes and writes.

        Blocks only for dispatch: no compilation, host sync or entropy coding (one process).
        """
        # 1. Validate.
        if not isinstance(args, LossySave):
            raise wrong_args(args, "LossySave")
        item_dir = final_path(abspath(directory))  # abspath keeps gs:// and s3:// URIs
        # One writer per root (orbax_lossy/format/lock.py): a second handler saving here fails.
        writer_lock.hold(self, item_dir, jax.process_index() == self.primary_host)
        item = os.path.basename(item_dir)
        pec = None
        if self.partial_experts is not None:  # partial experts: save the held experts only
            self._store.wait(item)
            pec = self.partial_experts.prepare_save(item_dir, args)
            args = pec.args
        paths, leaves, storages = validate_item(args.item)
        prepared, key_impls = save.prepare_leaves(leaves, storages)
        signature = save.signature(prepared, storages, key_impls)
        # 2. Base or delta: against the previous save's reference, once it is published.
        self._store.wait(item)
        held = self._store.get(item, wait=False)
        if pec is not None:  # partial experts: each held expert against its own reference
            held = pec.reference(held, paths, signature)
        ref = choose_reference(held, item_dir, paths, signature, force_base=args.force_base,
                               base_interval=self.base_interval, roots=self._roots,
                               unmanaged=self.unmanaged_deltas, primary_host=self.primary_host)
        header = save.make_header(
            item_dir=item_dir, ref=ref, base_interval=self.base_interval,
            chunk_bytes=self.chunk_bytes, primary_host=self.primary_host,
            extra_dependencies=pec.extra_dependencies if pec is not None else (),
            empty_nodes=empty_nodes(args.item),
        )
        self._store.record_dependencies(item_dir, set(header.depends_on))
        # 3. Copies the handler owns (the caller may donate its arrays once save() returns).
        request = save.SaveRequest(
            item_dir=item_dir, paths=paths, values=save.secure_copies(prepared, storages),
            storages=storages, key_impls=key_impls, ref=ref, header=header,
            policy=self.policy, chunk_bytes=self.chunk_bytes, primary_host=self.primary_host,
            roles=leaf_roles(args.item, keep_none=True),
            unit_axes=pec.unit_axes(paths) if pec is not None else {},
        )
        # 4. Several processes: dispatch the device programs here, in one order everywhere.
        dispatched = None
        if jax.process_count() > 1:
            _warn_cache_hang()  # once per process
            dispatched = save.dispatch_encode(request)
        # 5. The commit future: encode, publish the next reference, write the files.
        published = self._store.begin(item)
        directory_str, process = os.fspath(directory), jax.process_index()

        async def commit() -> None:
            try:
                running = dispatched if dispatched is not None else save.dispatch_encode(request)
                save.release_inputs(request)
                # Entropy coding and writing start on another thread as soon as the first
                # group of leaves is encoded; the reference is published once the device
                # programs are done, without waiting for the files.
                with concurrent.futures.ThreadPoolExecutor(1, "orbax_lossy_write") as writer:
                    written = writer.submit(self._write_files, directory_str, process,
                                            request.header, save.iter_jobs(request, running))
                    try:
                        self._publish(request, signature, running)
                        if pec is not None:
                            pec.publish(self._store.get(item, wait=False))
                    finally:
                        published.set()
                    written.result()
                request.values, request.ref = [], None
            except BaseException:
                self._store.drop(item)  # a failed save: the next one is a base
                raise
            finally:
                published.set()

        return [commit_future(commit(), name="orbax_lossy_write")]

    def _publish(self, request: save.SaveRequest, signature: Any,
                 running: save.Dispatched) -> None:
        """Make the reconstruction of this save the reference of the next one."""
        self._store.put(save.next_reference(request, signature, running,
                                            self.reference_on_host))
        self._last_save_stats = save.save_stats(request, running)

    def _write_files(self, directory: str, process: int, header: Any, jobs: Any) -> None:
        """Entropy-code and write this process's files (a commit worker; releases the GIL)."""
        is_primary = process == self.primary_host
        save.write_process_files(directory, process, header, jobs, is_primary,
                                 self.encode_threads)

    @property
    def last_save_stats(self) -> dict[str, Any]:
        """Kind of the last save and, per leaf, its codec and relative error."""
        self._store.wait(self._store.last_item)
        return self._last_save_stats

    def finalize(self, directory: epath.Path) -> None:
        """Merge the per-process indexes into ``manifest.msgpack`` (primary host only)."""
        save.merge_indexes(os.fspath(directory))

    def save(self, directory: epath.Path, *args: Any, **kwargs: Any) -> None:
        """Synchronous save (used by a bare ``ocp.Checkpointer``)."""
        asyncio.run(_wait_all(self.async_save(directory, *args, **kwargs)))


    def metadata(self, directory: epath.Path) -> Any:
        """Orbax ``TreeMetadata`` of the saved item (shape, dtype, sharding per leaf)."""
        return restoring.metadata_tree(read_manifest(directory), directory)

    def restore(self, directory: epath.Path, args: LossyRestore | None = None) -> Any:
        """Restore the item onto ``args.item`` (or nested dicts without a target)."""
        args = args if args is not None else LossyRestore()
        if not isinstance(args, LossyRestore):
            raise wrong_args(args, "LossyRestore")
        self._store.wait(os.path.basename(final_path(os.fspath(directory))))
        if self.partial_experts is not None:  # partial experts: each from its newest holder
            tree = self.partial_experts.restore(self, directory, args)
            if tree is not NotImplemented:
                return tree
        target = args.target()
        restored = restoring.restore_item(directory, target, self.encode_threads,
                                          partial=args.partial_restore)
        self.last_restore_bytes_read = restored.bytes_read
        if restored.complete:
            self._adopt_reference(restored)
        return restored.tree

    def _adopt_reference(self, restored: restoring.RestoredItem) -> None:
        """Make a complete restore the reference of its item's next save."""
        self._store.put(restored_reference(restored, self.reference_on_host))
        self._store.record_dependencies(restored.item_dir,
                                        set(restored.manifest.header.depends_on))


async def _wait_all(saving: Any) -> None:
    for future in await saving or []:
        future.result()


ocp.args.register_with_handler(LossyCheckpointHandler, for_save=True)(LossySave)
ocp.args.register_with_handler(LossyCheckpointHandler, for_restore=True)(LossyRestore)


def jax_cache_hangs_multiprocess(jax_version: str = jax.__version__) -> bool:
    """Whether this jax is one on which two CPU processes under ``jax.distributed`` hang in
    programs loaded from the persistent compilation cache (jax >= 0.12.1; any program with a
    collective, not only this library's: a 20-line reproduction in docs/performance.md)."""
    return tuple(int(p) for p in re.findall(r"\d+", jax_version)[:3]) >= (0, 12, 1)


def cpu_cache_hang_warning(jax_version: str, platforms: set[str], cache_dir: str | None,
                           process_count: int) -> str | None:
    """What to tell a multi-process CPU run with JAX's persistent compilation cache on where
    :func:`jax_cache_hangs_multiprocess`, or None."""
    if (process_count < 2 or platforms != {"cpu"} or not cache_dir
            or not jax_cache_hangs_multiprocess(jax_version)):
        return None
    return (f"jax {jax_version}: {process_count} CPU processes with JAX's persistent "
            f"compilation cache on ({cache_dir}): on jax 0.12.1 such runs hang in the "
            "programs they load from the cache (the run that compiled them finishes). If this "
            "run hangs in its first programs, turn the cache off (orbax-lossy's "
            "docs/performance.md has a 20-line reproduction)")


@functools.cache
def _warn_cache_hang() -> None:
    """:func:`cpu_cache_hang_warning` for this process, as a ``RuntimeWarning``, once."""
    message = cpu_cache_hang_warning(
        jax.__version__, {d.platform for d in jax.devices()},
        getattr(jax.config, "jax_compilation_cache_dir", None), jax.process_count())
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
