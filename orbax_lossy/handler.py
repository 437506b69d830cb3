"""``LossyCheckpointHandler``: an Orbax ``AsyncCheckpointHandler`` that writes delta chains.

Save (``async_save``, main thread): validate, choose base or delta, choose a codec per leaf,
run the one jitted encode program over the whole tree, copy the replica-0 shards of what
must be written to host, keep the reconstruction as the next reference, and return a commit
future. Entropy coding and file writes run in that future (Orbax's background thread, which
first waits for the step directory to exist). ``finalize`` (primary host only) merges the
per-process indexes into ``manifest.msgpack``.

Restore reads the manifest, walks the chain back to its base, rebuilds each field on the
target sharding from only the chunk-grid pieces that overlap the target shards, and runs the
jitted decode program, base first, then each delta.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import os
import re
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_lossy import format as fmt
from orbax_lossy import program, reading
from orbax_lossy.args import LossyRestore, LossySave, validate_item
from orbax_lossy.codecs.base import Codec, codec_config, codec_from_config
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.errors import (
    ChainError,
    FormatError,
    InvalidArgumentError,
    LossyError,
    MissingStepError,
)
from orbax_lossy.policy import LeafPolicy, Policy, leaf_role
from orbax_lossy.treepaths import StoredPath, build_nested, flatten, path_str

TYPESTR = "orbax_lossy.LossyCheckpointHandler"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
_HOST_KINDS = ("numpy", "int", "float", "bool")


# --------------------------------------------------------------------------- state


@dataclasses.dataclass
class _Reference:
    """The reconstruction of the last saved/restored checkpoint: the next delta's base."""

    item_dir: str  # final (committed) path of the item directory
    step: int | None
    chain_length: int
    paths: tuple[StoredPath, ...]
    signature: tuple[tuple[tuple[int, ...], str] | None, ...]
    values: list[Any]  # per leaf: device array, host numpy array, or None (host leaves)


@dataclasses.dataclass
class _LeafJob:
    index: int
    path: StoredPath
    kind: str
    shape: tuple[int, ...]
    dtype: np.dtype
    codec: Codec
    key_impl: str | None
    chunk: tuple[int, ...]
    side: dict[str, np.ndarray]
    shards: dict[str, list[tuple[fmt.Box, np.ndarray]]]  # field -> replica-0 shards on host
    rel_error: float
    role: str


def final_path(directory: os.PathLike | str) -> str:
    """The path a directory will have after Orbax commits it (tmp suffixes removed)."""
    parts = os.fspath(directory).split(os.sep)
    return os.sep.join(p.split(_TMP_SUFFIX)[0] for p in parts)


def step_of(item_dir: str) -> int | None:
    """Step number of an item directory ``<root>/<step dir>/<item>``, if its name has one."""
    name = os.path.basename(os.path.dirname(item_dir))
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else None


def _root_key(root: os.PathLike | str) -> str:
    return os.path.normpath(os.path.abspath(final_path(root)))


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name if not isinstance(dtype, str) else dtype


def _dtype_of(name: str, where: str) -> np.dtype:
    try:
        return np.dtype(jnp.dtype(name))
    except TypeError as e:
        raise FormatError(f"{where}: unknown dtype {name!r}") from e


def read_manifest(item_dir: os.PathLike | str) -> dict[str, Any]:
    path = os.path.join(os.fspath(item_dir), fmt.MANIFEST_NAME)
    body = fmt.read_envelope(path, "manifest")
    if not isinstance(body, dict) or not isinstance(body.get("leaves"), list):
        raise FormatError(f"{path}: manifest has no leaf table")
    return body


# --------------------------------------------------------------------------- handler


class LossyCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Orbax handler for lossy, delta-coded checkpoints of pytrees.

    Args:
      policy: per-leaf codec rules (default: LC-Checkpoint with 3 bits for float parameters,
        exact for optimizer state, integers and PRNG keys).
      base_interval: a full lossless base every ``base_interval`` saves; saves in between
        are deltas against the reconstruction of the previous save.
      chunk_bytes: target size of a chunk of the fixed chunk grid (of the raw array).
      reference_on_host: keep the reference reconstruction in host memory instead of on the
        device (single-process only).
      primary_host: the process that writes the manifest (match the manager's
        ``MultiprocessingOptions.primary_host``).
      encode_threads: threads for entropy coding in the background commit.
      unmanaged_deltas: take deltas in any directory, even where no
        :class:`~orbax_lossy.ChainPreservationPolicy` keeps the steps they depend on. Off by
        default: Orbax's own retention (``max_to_keep``, ``LatestN``, ...) deletes steps that
        later deltas need, so outside a chain-aware manager every save is a self-contained
        base (with a one-time warning). Turn it on only when nothing deletes old steps (a bare
        ``ocp.Checkpointer``, your own retention that keeps dependencies).
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        base_interval: int = 10,
        chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
        reference_on_host: bool = False,
        primary_host: int = 0,
        encode_threads: int | None = None,
        unmanaged_deltas: bool = False,
    ) -> None:
        if not isinstance(base_interval, int) or base_interval < 1:
            raise InvalidArgumentError(f"base_interval must be an int >= 1, got {base_interval!r}")
        if chunk_bytes < 1024:
            raise InvalidArgumentError(f"chunk_bytes must be >= 1024, got {chunk_bytes}")
        if reference_on_host and jax.process_count() > 1:
            raise InvalidArgumentError("reference_on_host is only supported in one process")
        self.policy = policy or LeafPolicy()
        self.base_interval = base_interval
        self.chunk_bytes = int(chunk_bytes)
        self.reference_on_host = reference_on_host
        self.primary_host = primary_host
        self.encode_threads = encode_threads or min(4, os.cpu_count() or 1)
        self.unmanaged_deltas = bool(unmanaged_deltas)
        self._protected_roots: set[str] = set()
        self._warned_roots: set[str] = set()
        self._reference: _Reference | None = None
        self._dependencies: dict[tuple[str, int], int | None] = {}
        self._lock = threading.Lock()
        self.last_restore_bytes_read = 0
        self.last_save_stats: dict[str, Any] = {}

    @classmethod
    def typestr(cls) -> str:
        return TYPESTR

    # ------------------------------------------------------------------ chain bookkeeping

    def dependency_of(self, root: str, step: int) -> int | None:
        """Step that ``step`` (under ``root``) depends on, from memory; KeyError if unknown."""
        with self._lock:
            return self._dependencies[(os.path.normpath(root), step)]

    def _record_dependency(self, item_dir: str, ref_step: int | None) -> None:
        step = step_of(item_dir)
        if step is None:
            return
        root = os.path.normpath(os.path.dirname(os.path.dirname(item_dir)))
        with self._lock:
            self._dependencies[(root, step)] = ref_step

    def protect_chains(self, root: os.PathLike | str) -> None:
        """Allow deltas under ``root``: its retention keeps every step a kept step needs.

        :class:`~orbax_lossy.ChainPreservationPolicy` calls this for its manager's directory.
        """
        with self._lock:
            self._protected_roots.add(_root_key(root))

    def chains_protected(self, root: os.PathLike | str) -> bool:
        """Whether deltas may be taken under ``root`` (see ``unmanaged_deltas``)."""
        with self._lock:
            return self.unmanaged_deltas or _root_key(root) in self._protected_roots

    def _warn_unprotected(self, root: str) -> None:
        with self._lock:
            if root in self._warned_roots:
                return
            self._warned_roots.add(root)
        warnings.warn(
            f"orbax_lossy: {root} is not managed by a ChainPreservationPolicy, so Orbax's "
            "retention could delete steps that delta checkpoints depend on; every save there is "
            "a self-contained base. To enable delta chains, build the manager with "
            "ol.checkpoint_manager(directory, ...) (extra items: items={...}), or wrap its "
            "preservation policy in ol.ChainPreservationPolicy(inner, handler, directory), or "
            "pass LossyCheckpointHandler(unmanaged_deltas=True) if nothing deletes old steps.",
            UserWarning,
            stacklevel=2,
        )

    def reset_reference(self) -> None:
        """Forget the reference: the next save is a full base."""
        self._reference = None

    # ------------------------------------------------------------------ save

    def _use_delta(
        self, item_dir: str, paths: Sequence[StoredPath], signature: tuple, force_base: bool
    ) -> _Reference | None:
        ref = self._reference
        if force_base or ref is None or self.base_interval <= 1:
            return None
        if ref.paths != tuple(paths) or ref.signature != signature:
            return None
        if ref.chain_length + 1 >= self.base_interval:
            return None
        if os.path.dirname(os.path.dirname(ref.item_dir)) != os.path.dirname(
            os.path.dirname(item_dir)
        ) or ref.item_dir == item_dir:
            return None
        # The reference must have been committed (a failed save leaves no manifest).
        if not os.path.exists(os.path.join(ref.item_dir, fmt.MANIFEST_NAME)):
            return None
        root = os.path.dirname(os.path.dirname(item_dir))
        if not self.chains_protected(root):
            self._warn_unprotected(_root_key(root))
            return None
        return ref

    def _agree_on_reference(self, ref: _Reference | None) -> _Reference | None:
        """Multi-process: every process follows the primary host's base/delta decision.

        ``_use_delta`` also looks for the reference's manifest on disk. On a shared filesystem
        without cross-host read-after-write consistency, one process may see it and another
        not; they would then run different encode programs (mismatched collectives) and write
        a base and a delta into one step. The in-memory checks are identical everywhere.
        """
        from jax.experimental import multihost_utils

        use = multihost_utils.broadcast_one_to_all(
            np.int32(ref is not None), is_source=jax.process_index() == self.primary_host
        )
        if not int(use):
            return None
        if ref is None and self._reference is None:
            raise ChainError("the primary host saves a delta but this process has no reference")
        return ref if ref is not None else self._reference

    async def async_save(
        self, directory: epath.Path, args: LossySave
    ) -> list[ocp.future.Future] | None:
        if not isinstance(args, LossySave):
            raise InvalidArgumentError(f"expected LossySave args, got {type(args).__name__}")
        item_dir = final_path(directory)
        paths, leaves, kinds = validate_item(args.item)

        prepared, key_impls = [], []
        for leaf, kind in zip(leaves, kinds, strict=True):
            impl = None
            if kind == "device" and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                impl = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            prepared.append(leaf if kind == "device" else np.asarray(jax.device_get(leaf)))
            key_impls.append(impl)
        signature = tuple(
            _delta_signature(kind == "device" and impl is None, np.shape(x), x.dtype)
            for x, kind, impl in zip(prepared, kinds, key_impls, strict=True)
        )
        ref = self._use_delta(item_dir, paths, signature, args.force_base)
        if jax.process_count() > 1:
            ref = self._agree_on_reference(ref)
        is_base = ref is None

        device_idx = [i for i, k in enumerate(kinds) if k == "device" and key_impls[i] is None]
        refs: list[Any] = [None] * len(prepared)
        if ref is not None:
            for i in device_idx:
                r = ref.values[i]
                if isinstance(r, np.ndarray):
                    r = jax.device_put(r, prepared[i].sharding)
                refs[i] = r
        plan: list[Codec] = [Exact() for _ in prepared]
        chosen = self.policy.plan(
            [paths[i] for i in device_idx],
            [prepared[i] for i in device_idx],
            [refs[i] for i in device_idx],
            is_base,
        )
        for i, codec in zip(device_idx, chosen, strict=True):
            if is_base and codec.needs_reference:
                raise LossyError(f"policy chose delta codec {codec} for a base save")
            plan[i] = codec
        device_idx = [i for i, k in enumerate(kinds) if k == "device"]
        per_leaf = bool(getattr(self.policy, "plan_varies", False))
        encoded = _run_grouped(
            program.encode_tree,
            per_leaf,
            [prepared[i] for i in device_idx],
            [refs[i] for i in device_idx],
            plan=tuple(plan[i] for i in device_idx),
            shardings=tuple(prepared[i].sharding for i in device_idx),
        )

        # Start every device-to-host copy, then wait for them (host copies secured).
        pending: list[tuple[int, str, list[tuple[fmt.Box, jax.Array]]]] = []
        for j, i in enumerate(device_idx):
            for name, arr in encoded[j]["fields"].items():
                shards = [s for s in arr.addressable_shards if s.replica_id == 0]
                for s in shards:
                    s.data.copy_to_host_async()
                pending.append(
                    (i, name, [(fmt.box_from_index(s.index, arr.shape), s.data) for s in shards])
                )
        host_fields: dict[int, dict[str, list[tuple[fmt.Box, np.ndarray]]]] = {}
        for i, name, shards in pending:
            host_fields.setdefault(i, {})[name] = [(box, np.asarray(d)) for box, d in shards]
        flags = jax.device_get([(e["safe"], e["rel_error"], e["side"]) for e in encoded])

        recon: list[Any] = [None] * len(prepared)
        jobs: list[_LeafJob] = []
        is_primary = jax.process_index() == self.primary_host
        for j, i in enumerate(device_idx):
            safe, rel_error, side = flags[j]
            codec = plan[i]
            recon[i] = encoded[j]["recon"]
            if not bool(safe):
                # Non-finite input or a sign-breaking reconstruction (program.encode_tree):
                # store this leaf exactly for this save (never garbage).
                codec = Exact()
                arr = prepared[i]
                shards = [s for s in arr.addressable_shards if s.replica_id == 0]
                host_fields[i] = {
                    "raw": [(fmt.box_from_index(s.index, arr.shape), np.asarray(s.data))
                            for s in shards]
                }
                side, rel_error = {}, 0.0
            jobs.append(self._job(i, paths[i], "device", prepared[i], codec, key_impls[i],
                                  {k: np.asarray(v) for k, v in side.items()},
                                  host_fields.get(i, {}), float(rel_error)))
        for i, kind in enumerate(kinds):
            if kind == "device":
                continue
            arr = prepared[i]
            box = tuple((0, d) for d in arr.shape)
            shards = {"raw": [(box, arr.copy())]} if is_primary else {"raw": []}
            jobs.append(self._job(i, paths[i], kind, arr, Exact(), None, {}, shards, 0.0))
        jobs.sort(key=lambda job: job.index)

        if self.reference_on_host:
            recon = [np.asarray(r) if r is not None else None for r in recon]
        reference_entry = None
        if ref is not None:
            reference_entry = {
                "relpath": os.path.relpath(ref.item_dir, item_dir),
                "step": ref.step,
            }
        header = {
            "step": step_of(item_dir),
            "kind": "base" if is_base else "delta",
            "chain_length": 0 if is_base else ref.chain_length + 1,
            "base_interval": self.base_interval,
            "reference": reference_entry,
            "chunk_bytes": self.chunk_bytes,
            "process_count": jax.process_count(),
            "primary_host": self.primary_host,
            "programs": "per_leaf" if per_leaf else "tree",
            "writer": "orbax-lossy",
        }
        self._reference = _Reference(
            item_dir=item_dir,
            step=step_of(item_dir),
            chain_length=header["chain_length"],
            paths=tuple(paths),
            signature=signature,
            values=recon,
        )
        self._record_dependency(item_dir, ref.step if ref is not None else None)
        self.last_save_stats = {
            "kind": header["kind"],
            "leaves": {path_str(job.path): {"codec": job.codec.codec_id,
                                             "rel_error": job.rel_error} for job in jobs},
        }

        process = jax.process_index()
        commit = ocp.future.CommitFutureAwaitingContractedSignals(
            self._write(directory, process, jobs, header if is_primary else None),
            name="orbax_lossy_write",
        )
        return [commit]

    def _job(self, i, path, kind, arr, codec, impl, side, shards, rel_error) -> _LeafJob:
        dtype = np.dtype(arr.dtype)
        return _LeafJob(
            index=i,
            path=path,
            kind=kind,
            shape=tuple(int(d) for d in np.shape(arr)),
            dtype=dtype,
            codec=codec,
            key_impl=impl,
            chunk=fmt.chunk_shape_for(np.shape(arr), dtype.itemsize, self.chunk_bytes),
            side=side,
            shards=shards,
            rel_error=rel_error,
            role=leaf_role(path, dtype) if impl is None else "rng",
        )

    async def _write(
        self,
        directory: epath.Path,
        process: int,
        jobs: list[_LeafJob],
        header: dict[str, Any] | None,
    ) -> None:
        # This coroutine already runs on Orbax's commit thread (its own event loop), after the
        # directory exists; the work itself releases the GIL (numba kernels, zlib, file I/O).
        self._write_files(os.fspath(directory), process, jobs, header)

    def _write_files(
        self, directory: str, process: int, jobs: list[_LeafJob], header: dict[str, Any] | None
    ) -> None:
        tasks = []
        for job in jobs:
            field_dtypes = job.codec.field_dtypes(job.dtype)
            for name, shards in job.shards.items():
                if name not in field_dtypes:
                    raise LossyError(f"leaf {path_str(job.path)}: codec gave unknown field {name}")
                for box, host in shards:
                    for piece in fmt.grid_pieces(box, job.chunk):
                        local = host[fmt.local_slices(piece, box)] if piece else host
                        tasks.append((job, name, piece, local))

        def encode(task):
            job, name, piece, local = task
            return job.codec.host_encode(name, np.ascontiguousarray(local))

        writer = fmt.PayloadWriter(os.path.join(directory, fmt.data_file_name(process)))
        pieces: dict[int, list[dict[str, Any]]] = {job.index: [] for job in jobs}
        try:
            with concurrent.futures.ThreadPoolExecutor(self.encode_threads) as pool:
                for task, payload in zip(tasks, pool.map(encode, tasks), strict=True):
                    job, name, piece, _ = task
                    pieces[job.index].append(writer.append(name, piece, payload).to_msgpack())
        finally:
            writer.close()
        body: dict[str, Any] = {
            "process": process,
            "pieces": [[index, plist] for index, plist in pieces.items()],
        }
        if header is not None:
            body["header"] = header
            body["leaves"] = [self._leaf_entry(job) for job in jobs]
        fmt.write_envelope(os.path.join(directory, fmt.index_file_name(process)), "index", body)

    @staticmethod
    def _leaf_entry(job: _LeafJob) -> dict[str, Any]:
        return {
            "path": [list(p) for p in job.path],
            "kind": job.kind,
            "shape": list(job.shape),
            "dtype": job.dtype.name,
            "key_impl": job.key_impl,
            "codec": codec_config(job.codec),
            "chunk": list(job.chunk),
            "side": {
                k: {"dtype": v.dtype.name, "shape": list(v.shape), "data": v.tobytes()}
                for k, v in job.side.items()
            },
            "role": job.role,
            "rel_error": job.rel_error,
        }

    def finalize(self, directory: epath.Path) -> None:
        """Merge the per-process indexes into ``manifest.msgpack`` (primary host only)."""
        directory = os.fspath(directory)
        names = sorted(n for n in os.listdir(directory) if re.fullmatch(r"index\.p\d+\.msgpack", n))
        bodies = [fmt.read_envelope(os.path.join(directory, n), "index") for n in names]
        headers = [b for b in bodies if "header" in b]
        if len(headers) != 1:
            raise FormatError(f"{directory}: expected one primary index, found {len(headers)}")
        primary = headers[0]
        expected = primary["header"]["process_count"]
        if len(bodies) != expected:
            raise FormatError(
                f"{directory}: {len(bodies)} of {expected} processes wrote their index"
            )
        leaves = primary["leaves"]
        for body in bodies:
            for index, plist in body["pieces"]:
                leaves[index].setdefault("pieces", []).extend(plist)
        for leaf in leaves:
            leaf.setdefault("pieces", [])
            fmt.check_coverage(leaf, directory)
            leaf["stored_bytes"] = sum(p["length"] for p in leaf["pieces"])
        manifest = dict(primary["header"])
        manifest["leaves"] = leaves
        fmt.write_envelope(os.path.join(directory, fmt.MANIFEST_NAME), "manifest", manifest)
        for n in names:
            os.remove(os.path.join(directory, n))

    def save(self, directory: epath.Path, *args: Any, **kwargs: Any) -> None:
        """Synchronous save (used by a bare ``ocp.Checkpointer``)."""

        async def run() -> None:
            futures = await self.async_save(directory, *args, **kwargs)
            for f in futures or []:
                f.result()

        asyncio.run(run())

    # ------------------------------------------------------------------ restore

    def metadata(self, directory: epath.Path) -> Any:
        """Tree of ``jax.ShapeDtypeStruct`` of the saved item (no payload is read)."""
        manifest = read_manifest(directory)
        paths, leaves = [], []
        for leaf in manifest["leaves"]:
            paths.append(tuple((k, v) for k, v in leaf["path"]))
            dtype = _dtype_of(leaf["dtype"], os.fspath(directory))
            shape = tuple(leaf["shape"])
            if leaf.get("key_impl"):  # show the PRNG key array, not its uint32 key data
                impl = leaf["key_impl"]
                leaves.append(jax.eval_shape(
                    lambda s=shape, d=dtype, impl=impl: jax.random.wrap_key_data(
                        jnp.zeros(s, d), impl=impl)))
                continue
            leaves.append(jax.ShapeDtypeStruct(shape, dtype))
        return build_nested(paths, leaves)

    def chain(self, directory: os.PathLike | str) -> list[tuple[str, dict[str, Any]]]:
        """(item dir, manifest) from the chain's base to ``directory``."""
        chain = []
        current = os.path.normpath(os.fspath(directory))
        seen = set()
        while True:
            manifest_path = os.path.join(current, fmt.MANIFEST_NAME)
            if not os.path.exists(manifest_path):
                step = step_of(current)
                if chain:
                    raise MissingStepError(
                        f"step {chain[-1][1].get('step')} depends on step {step}, whose "
                        f"checkpoint {current} is missing; the chain is broken",
                        step=step,
                    )
                raise FormatError(f"{manifest_path} is missing: not a committed checkpoint")
            manifest = read_manifest(current)
            chain.append((current, manifest))
            if current in seen or len(chain) > 100_000:
                raise ChainError(f"{current}: the delta chain loops")
            seen.add(current)
            reference = manifest.get("reference")
            if manifest.get("kind") == "base" or reference is None:
                break
            current = os.path.normpath(os.path.join(current, reference["relpath"]))
        chain.reverse()
        return chain

    def restore(self, directory: epath.Path, args: LossyRestore | None = None) -> Any:
        args = args if args is not None else LossyRestore()
        if not isinstance(args, LossyRestore):
            raise InvalidArgumentError(f"expected LossyRestore args, got {type(args).__name__}")
        item_dir = os.path.normpath(os.fspath(directory))
        chain = self.chain(item_dir)
        final_manifest = chain[-1][1]
        stored_paths = [tuple((k, v) for k, v in leaf["path"]) for leaf in final_manifest["leaves"]]
        selected, targets, treedef = self._targets(item_dir, stored_paths, final_manifest, args)

        starts = _first_needed_links(chain, selected)
        values: list[Any] | None = None
        bytes_read = 0
        for position, (link_dir, manifest) in enumerate(chain):
            active = [position >= start for start in starts]
            if not any(active):
                continue
            reader = fmt.PayloadReader(link_dir)
            values = self._decode_link(
                link_dir, manifest, selected, targets, values, reader, active
            )
            bytes_read += reader.bytes_read
        self.last_restore_bytes_read = bytes_read
        assert values is not None

        out = []
        for k, i in enumerate(selected):
            leaf = final_manifest["leaves"][i]
            value = values[k]
            if leaf.get("key_impl"):
                value = jax.random.wrap_key_data(value, impl=leaf["key_impl"])
            out.append(reading.cast_to_target(value, targets[k], leaf))
        if len(selected) == len(stored_paths):
            self._adopt_reference(item_dir, final_manifest, stored_paths, values)
        if treedef is None:
            return build_nested([stored_paths[i] for i in selected], out)
        return jax.tree_util.tree_unflatten(treedef, out)

    def _targets(self, item_dir, stored_paths, manifest, args):
        if args.item is None:
            return list(range(len(stored_paths))), [None] * len(stored_paths), None
        paths, leaves, treedef = flatten(args.item)
        index = {p: i for i, p in enumerate(stored_paths)}
        selected = []
        for p in paths:
            if p not in index:
                raise InvalidArgumentError(
                    f"restore target leaf {path_str(p)!r} is not in checkpoint {item_dir}"
                )
            selected.append(index[p])
        for p, leaf, i in zip(paths, leaves, selected, strict=True):
            stored = tuple(manifest["leaves"][i]["shape"])
            shape = getattr(leaf, "shape", None)
            dtype = getattr(leaf, "dtype", None)
            if shape is not None and dtype is not None and jax.dtypes.issubdtype(
                dtype, jax.dtypes.prng_key
            ):  # a PRNG key target: compare its key-data shape with the stored one
                shape = jax.eval_shape(
                    jax.random.key_data, jax.ShapeDtypeStruct(tuple(shape), dtype)
                ).shape
            if shape is not None and tuple(shape) != stored:
                raise InvalidArgumentError(
                    f"leaf {path_str(p)!r}: target shape {tuple(shape)} != stored shape {stored} "
                    f"in {item_dir}"
                )
        return selected, leaves, treedef

    def _decode_link(self, link_dir, manifest, selected, targets, previous, reader, active):
        where = link_dir
        device_k, plan, dtypes, shardings, fields, sides, refs = [], [], [], [], [], [], []
        out: list[Any] = [None] * len(selected)
        leaves = manifest["leaves"]
        for k, i in enumerate(selected):
            if i >= len(leaves):
                raise ChainError(f"{where}: leaf table does not match the chain's last step")
            if not active[k]:  # a later link stores this leaf whole: nothing to read here
                continue
            leaf = leaves[i]
            lw = f"{where}: leaf {path_str(tuple((a, b) for a, b in leaf['path']))!r}"
            codec = codec_from_config(leaf["codec"], lw)
            dtype = _dtype_of(leaf["dtype"], lw)
            shape = tuple(int(d) for d in leaf["shape"])
            if math.prod(shape) > (1 << 40):
                raise FormatError(f"{lw}: impossible shape {shape}")
            pieces = [fmt.PieceRef.from_msgpack(p, lw) for p in leaf.get("pieces", [])]
            storage_dtype = dtype if not leaf.get("key_impl") else dtype
            if leaf["kind"] in _HOST_KINDS:
                box = tuple((0, d) for d in shape)
                arr = reading.read_region(reader, pieces, codec, "raw", storage_dtype, box, {}, lw)
                out[k] = arr
                continue
            sharding = reading.target_sharding(targets[k])
            field_arrays = {}
            for name, fdtype in codec.field_dtypes(storage_dtype).items():
                fpieces = [p for p in pieces if p.field == name]
                field_arrays[name] = reading.assemble_field(
                    reader, fpieces, codec, name, fdtype, shape, sharding, lw, self.encode_threads
                )
            side = {}
            for name, s in leaf.get("side", {}).items():
                sd = _dtype_of(s["dtype"], lw)
                sshape = tuple(s["shape"])
                if len(s["data"]) != math.prod(sshape) * sd.itemsize:
                    raise FormatError(f"{lw}: side array {name!r} has the wrong size")
                side[name] = jnp.asarray(np.frombuffer(s["data"], sd).reshape(sshape))
            ref = None
            if codec.needs_reference:
                if previous is None or previous[k] is None:
                    raise ChainError(f"{lw}: a delta leaf has no reference (chain starts here)")
                ref = previous[k]
            device_k.append(k)
            plan.append(codec)
            dtypes.append(storage_dtype)
            shardings.append(sharding)
            fields.append(field_arrays)
            sides.append(side)
            refs.append(ref)
        if device_k:
            decoded = _run_grouped(
                program.decode_tree,
                manifest.get("programs") == "per_leaf",
                fields, sides, refs, plan=tuple(plan), dtypes=tuple(dtypes),
                shardings=tuple(shardings),
            )
            for k, v in zip(device_k, decoded, strict=True):
                out[k] = v
        return out

    def _adopt_reference(self, item_dir, manifest, paths, values) -> None:
        kinds = [leaf["kind"] for leaf in manifest["leaves"]]
        copies = _copy_tree([v if kind == "device" else None for v, kind in zip(values, kinds,
                                                                                 strict=True)])
        if self.reference_on_host:
            copies = [np.asarray(v) if v is not None else None for v in copies]
        signature = tuple(
            _delta_signature(
                leaf["kind"] == "device" and not leaf.get("key_impl"),
                leaf["shape"],
                _dtype_of(leaf["dtype"], item_dir),
            )
            for leaf in manifest["leaves"]
        )
        self._reference = _Reference(
            item_dir=item_dir,
            step=manifest.get("step"),
            chain_length=int(manifest.get("chain_length", 0)),
            paths=tuple(paths),
            signature=signature,
            values=copies,
        )
        ref = manifest.get("reference")
        self._record_dependency(item_dir, ref.get("step") if ref else None)


ocp.args.register_with_handler(LossyCheckpointHandler, for_save=True)(LossySave)
ocp.args.register_with_handler(LossyCheckpointHandler, for_restore=True)(LossyRestore)


def _first_needed_links(chain: list[tuple[str, dict[str, Any]]], selected: list[int]) -> list[int]:
    """Per selected leaf, the last link of the chain that stores it without a reference.

    Restoring a leaf only needs the links from there on: an exact leaf (a step counter, an
    optimizer state kept exact) is read from the newest checkpoint alone, not from every link.
    """
    starts = []
    for i in selected:
        start = 0
        for position, (link_dir, manifest) in enumerate(chain):
            leaves = manifest["leaves"]
            if i >= len(leaves):
                raise ChainError(f"{link_dir}: leaf table does not match the chain's last step")
            if not codec_from_config(leaves[i]["codec"], link_dir).needs_reference:
                start = position
        starts.append(start)
    return starts


def _run_grouped(fn, per_leaf: bool, *lists: list[Any], **statics: tuple[Any, ...]) -> list[Any]:
    """Run a tree program once over all leaves, or once per leaf (then cached per leaf).

    A static per-leaf plan compiles one program for the whole tree. A plan that changes from
    save to save (adaptive policies) would recompile that program at every new combination,
    so such saves run one small program per leaf, cached by leaf shape, dtype and codec.
    """
    if not per_leaf:
        return fn(*lists, **statics)
    out = []
    for j in range(len(lists[0])):
        out.extend(
            fn(*[[arg[j]] for arg in lists], **{k: (v[j],) for k, v in statics.items()})
        )
    return out


@jax.jit
def _copy_tree(values):
    return [None if v is None else jnp.copy(v) for v in values]


def _delta_signature(on_device: bool, shape: Any, dtype: Any) -> tuple | None:
    """What must not change between a reference and the next save for a delta to be taken.

    Only float device leaves can be delta-coded; the others are always stored whole, so a
    step counter that turns from a Python int into a jax.Array does not force a new base.
    """
    if on_device and jnp.issubdtype(dtype, jnp.floating):
        return (tuple(int(d) for d in shape), np.dtype(dtype).name)
    return None
