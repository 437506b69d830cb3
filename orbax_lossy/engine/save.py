"""The save pipeline: secure inputs (blocking part), then encode and write (commit thread).

0. Training thread (``async_save``): :func:`secure_copies` secures inputs the handler owns
   (on CPU zero-copy holds of ready leaves, elsewhere dispatched device copies; nothing
   compiled, nothing waited for) and :func:`make_header` fixes the
   base/delta decision and the dependencies; together they form a :class:`SaveRequest`.
1. :func:`dispatch_encode`: the policy's codec plan and the jitted encode program(s) over
   groups of leaves, plus the start of the device-to-host copies. In one process this runs in
   the commit thread; with several processes the dispatch stays on the training thread
   (collectives in one order).
2. :func:`write_process_files` (Orbax's commit thread, after the directory exists) consumes
   :func:`iter_jobs`, which yields each leaf's host buffers as soon as its own group is
   encoded: every chunk-grid piece is entropy-coded on a thread pool while later groups are
   still encoding, appended to ``data.p<K>.bin``, and ``index.p<K>.msgpack`` is written.
   Meanwhile :func:`next_reference` and :func:`save_stats` publish the reconstruction once
   the device programs are done.
3. :func:`merge_indexes` (``finalize``, primary host): merge the indexes into the manifest.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import re
import secrets
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from orbax_lossy import dtypes
from orbax_lossy.codecs.base import Codec, codec_config
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.same import Same
from orbax_lossy.engine import cpu_encode, device, transfer
from orbax_lossy.engine.reference import Reference, Signature, delta_signature
from orbax_lossy.errors import FormatError, LossyError
from orbax_lossy.format import envelope, grid, payload, steps
from orbax_lossy.format.manifest import (
    Header,
    LeafEntry,
    Manifest,
    ReferenceLink,
    write_manifest,
)
from orbax_lossy.format.steps import step_of
from orbax_lossy.policy import Policy, leaf_role
from orbax_lossy.treepaths import StoredPath, path_str

HostShards = list[tuple[grid.Box, np.ndarray]]


@dataclasses.dataclass
class LeafJob:
    """One leaf to write: its manifest entry (without pieces) and its host buffers."""

    index: int
    entry: LeafEntry
    shards: dict[str, HostShards]  # field -> replica-0 shards on host


def signature(prepared: Sequence[Any], storages: Sequence[str],
              key_impls: Sequence[str | None]) -> Signature:
    """What must not change between the reference and this save for a delta."""
    return tuple(
        delta_signature(s == "device" and impl is None, np.shape(x), x.dtype)
        for x, s, impl in zip(prepared, storages, key_impls, strict=True)
    )


@functools.lru_cache(maxsize=256)
def sharding_string(sharding: jax.sharding.Sharding) -> str | None:
    """Orbax's serialized sharding metadata (restores without a target reuse it)."""
    from orbax.checkpoint._src.metadata import sharding as sharding_metadata

    try:
        meta = sharding_metadata.from_jax_sharding(sharding)
    except Exception:  # a sharding type Orbax cannot describe: restored on a default
        return None
    return None if meta is None else meta.to_serialized_string()


def next_reference(request: SaveRequest, signature: Signature, running: Dispatched,
                   on_host: bool) -> Reference:
    """The reference the next save of this item is encoded against: this reconstruction."""
    values = reconstruction(request, running, on_host)
    header = request.header
    return Reference(request.item_dir, header.step, header.save_id, header.chain_length,
                     tuple(request.paths), signature, values)


def save_id() -> str:
    """A random identifier that binds a delta to the exact save it was encoded against."""
    return secrets.token_hex(8)


def prepare_leaves(leaves: Sequence[Any], storages: Sequence[str]) -> tuple[list, list]:
    """Device leaves stay jax.Arrays (PRNG keys as key data); host leaves become numpy."""
    prepared, key_impls = [], []
    for leaf, storage in zip(leaves, storages, strict=True):
        impl = None
        if storage == "device" and dtypes.kind(leaf.dtype) == "rng":
            impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        prepared.append(leaf if storage == "device" else np.asarray(jax.device_get(leaf)))
        key_impls.append(impl)
    return prepared, key_impls


def secure_copies(prepared: Sequence[Any], storages: Sequence[str]) -> list[Any]:
    """Copies of the leaves that the handler owns, so the caller may donate or overwrite its
    arrays as soon as ``save()`` returns.

    A ready device leaf on CPU devices is held without a copy (``transfer.hold_on_host``:
    numpy views of its buffers make the runtime refuse their donation; a single-shard leaf
    stays a ``transfer.HostHold`` until :func:`dispatch_encode` builds its array). Any other
    device leaf is copied on its devices by ``jax.device_put(..., may_alias=False)``: an
    asynchronous device-to-device copy per shard that compiles nothing and returns at once
    (JAX orders a later donation of the original after the copy). A host leaf is copied now.
    """
    device_leaves = [i for i, s in enumerate(storages) if s == "device"]
    held = dict(zip(device_leaves, transfer.hold_on_host([prepared[i] for i in device_leaves]),
                    strict=True))
    on_device = [i for i, h in held.items() if h is None]
    # one batched call for every device leaf (per-leaf calls cost ~0.5 ms each in dispatch)
    copies = jax.device_put([prepared[i] for i in on_device],
                            [prepared[i].sharding for i in on_device],
                            may_alias=False, donate=False)
    out: list[Any] = [None if s == "device" else np.array(x, copy=True)
                      for x, s in zip(prepared, storages, strict=True)]
    for i, copy in zip(on_device, copies, strict=True):
        out[i] = copy
    for i, hold in held.items():
        if hold is not None:
            out[i] = hold
    return out


def make_header(
    *,
    item_dir: str,
    ref: Reference | None,
    base_interval: int,
    chunk_bytes: int,
    primary_host: int,
    extra_dependencies: Sequence[int] = (),
    empty_nodes: Sequence[tuple[StoredPath, str]] = (),
) -> Header:
    """The manifest header of a save, known before anything is encoded (retention reads the
    dependencies on the training thread, right after ``save()`` returns)."""
    return Header(
        step=step_of(item_dir),
        save_type="base" if ref is None else "delta",
        chain_length=0 if ref is None else ref.chain_length + 1,
        base_interval=base_interval,
        reference=None
        if ref is None
        else ReferenceLink(steps.relpath(ref.item_dir, item_dir), ref.step, ref.save_id),
        chunk_bytes=chunk_bytes,
        process_count=jax.process_count(),
        primary_host=primary_host,
        programs="per_leaf",
        save_id=save_id(),
        extra_dependencies=tuple(int(s) for s in extra_dependencies),
        empty_nodes=tuple(empty_nodes),
    )


def _replica0_shards(arr: jax.Array) -> list[tuple[grid.Box, jax.Array]]:
    return [
        (grid.box_from_index(s.index, arr.shape), s.data)
        for s in arr.addressable_shards
        if s.replica_id == 0
    ]


@dataclasses.dataclass
class SaveRequest:
    """What the blocking half of a save hands over: handler-owned inputs and the header."""

    item_dir: str
    paths: Sequence[StoredPath]
    values: list[Any]  # handler-owned copies (see secure_copies)
    storages: Sequence[str]
    key_impls: Sequence[str | None]
    ref: Reference | None
    header: Header
    policy: Policy
    chunk_bytes: int
    primary_host: int
    roles: Sequence[str] | None = None  # per leaf, from the framework (policy.roles)
    # per leaf index, axes its pieces are cut along per index (partial experts' slots)
    unit_axes: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Dispatched:
    """Device programs dispatched for a save (their results may still be computing)."""

    plan: list[Codec]
    device_leaves: list[int]
    encoded: Sequence[dict[str, Any]]  # a list, or device.Pending (single process)
    # per device leaf, its fields' replica-0 shards on their way to the host
    copies: Sequence[dict[str, list[tuple[grid.Box, transfer.HostCopy]]]]


def _host_copies(out: dict[str, Any]) -> dict[str, list[tuple[grid.Box, transfer.HostCopy]]]:
    return {name: [(box, transfer.HostCopy(data)) for box, data in _replica0_shards(arr)]
            for name, arr in out["fields"].items()}


class _OnHost:
    """A field already in host memory (a host kernel's output), read like a ``HostCopy``."""

    def __init__(self, host: np.ndarray) -> None:
        self._host = host

    def result(self) -> np.ndarray:
        return self._host


def _encode_leaf(value: Any, ref: Any, codec: Codec, sharding: Any) -> tuple[dict, dict]:
    kind = cpu_encode.host_kernel(value, ref, codec)
    if kind is not None:  # float32 LC/Step on one CPU device: numba, not an XLA program
        out = cpu_encode.encode(value, ref, codec, kind)
        box = grid.full_box(np.shape(value))
        return out, {name: [(box, _OnHost(host))] for name, host in out["fields"].items()}
    out = device.encode_tree([value], [ref], plan=(codec,), shardings=(sharding,))[0]
    return out, _host_copies(out)


def dispatch_encode(req: SaveRequest) -> Dispatched:
    """Choose codecs and dispatch the encode program(s); start the device-to-host copies.

    Compiles on the first call per shapes and plan. Runs the same programs in the same order
    on every process (their reductions are collectives). Does not wait for results, except
    what the policy itself reads (an adaptive policy's statistics).
    """
    prepared = [device.strong(x) for x in transfer.materialize(req.values)]
    storages, key_impls, ref = req.storages, req.key_impls, req.ref
    is_base = ref is None
    codec_leaves = [
        i for i, s in enumerate(storages) if s == "device" and key_impls[i] is None
    ]
    refs: list[Any] = [None] * len(prepared)
    if ref is not None:
        for i in codec_leaves:
            r = ref.values[i]
            if isinstance(r, np.ndarray):
                r = jax.device_put(r, prepared[i].sharding)
            refs[i] = device.strong(r)
    plan: list[Codec] = [Exact() for _ in prepared]
    chosen = req.policy.plan(
        [req.paths[i] for i in codec_leaves],
        [prepared[i] for i in codec_leaves],
        [refs[i] for i in codec_leaves],
        is_base,
        roles=None if req.roles is None else [req.roles[i] for i in codec_leaves],
    )
    for i, codec in zip(codec_leaves, chosen, strict=True):
        if is_base and codec.needs_reference:
            raise LossyError(f"policy chose delta codec {codec} for a base save")
        plan[i] = codec
    device_leaves = [i for i, s in enumerate(storages) if s == "device"]
    # Programs with collectives (several processes, or a leaf sharded over several devices)
    # are dispatched in one order: from two threads they could be enqueued in different
    # orders on different devices and wait for each other.
    jobs = [(prepared[i], refs[i], plan[i], prepared[i].sharding) for i in device_leaves]
    if jax.process_count() > 1 or any(len(prepared[i].sharding.device_set) > 1
                                      for i in device_leaves):
        done = [_encode_leaf(*job) for job in jobs]
        return Dispatched(plan, device_leaves, [d[0] for d in done], [d[1] for d in done])
    futures = [device.leaf_pool().submit(_encode_leaf, *job) for job in jobs]
    return Dispatched(plan, device_leaves, device.Pending(futures, lambda r: r[0]),
                      device.Pending(futures, lambda r: r[1]))


def release_inputs(req: SaveRequest) -> None:
    """Drop the request's hold on the handler's device copies and on the previous reference
    once the encode programs are dispatched (shapes, dtypes and shardings stay for the
    manifest). The runtime keeps each buffer alive until the programs that read it are done,
    so a save's extra memory is freed group by group while the entropy coder is still
    running, instead of after the last file is written. A failed save drops the item's
    reference anyway (the next save is a base)."""
    req.values = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                  if s == "device" else v for v, s in zip(req.values, req.storages, strict=True)]
    if req.ref is not None:
        req.ref.values[:] = [None] * len(req.ref.values)


def _leaf_job(req: SaveRequest, i: int, codec: Codec, side: dict,
              shards: dict[str, HostShards], err: float) -> LeafJob:
    arr = req.values[i]  # metadata only: a device value may already be released
    dtype = np.dtype(arr.dtype)
    entry = LeafEntry(
        path=req.paths[i],
        storage=req.storages[i],
        shape=tuple(int(d) for d in np.shape(arr)),
        dtype=dtype,
        key_impl=req.key_impls[i],
        codec_config=codec_config(codec),
        chunk=grid.chunk_shape_for(np.shape(arr), dtype.itemsize, req.chunk_bytes),
        side={k: np.asarray(v) for k, v in side.items()},
        role=("rng" if req.key_impls[i] is not None else
              req.roles[i] if req.roles is not None else leaf_role(req.paths[i], dtype)),
        rel_error=float(err),
        sharding=sharding_string(arr.sharding) if req.storages[i] == "device" else None,
    )
    return LeafJob(i, entry, shards)


def reconstruction(req: SaveRequest, dispatched: Dispatched, on_host: bool = False
                   ) -> list[Any]:
    """Per leaf the next reference value (device leaves; an XLA program's may still be
    computing), else None; numpy arrays where ``on_host``.

    A host kernel's reconstruction is a numpy array (``cpu_encode``): those of all leaves go
    to their devices in one ``jax.device_put`` (zero-copy on a CPU device for the kernels'
    aligned buffers; 360 leaves of 46 k float32 elements: 40-68 us a leaf batched against
    71-105 us one by one), or stay on the host where ``on_host``."""
    out: list[Any] = [None] * len(req.values)
    on_numpy: list[int] = []
    for j, i in enumerate(dispatched.device_leaves):
        recon = out[i] = dispatched.encoded[j]["recon"]
        if isinstance(recon, np.ndarray):
            on_numpy.append(i)
    if on_host:
        return [r if r is None or isinstance(r, np.ndarray) else np.asarray(r) for r in out]
    if on_numpy:
        placed = jax.device_put([out[i] for i in on_numpy],
                                [req.values[i].sharding for i in on_numpy])
        for i, value in zip(on_numpy, placed, strict=True):
            out[i] = value
    return out


def iter_jobs(req: SaveRequest, dispatched: Dispatched) -> Iterator[LeafJob]:
    """The leaf jobs (host buffers) in leaf order, each as soon as its own device program has
    finished: entropy coding of the first leaves overlaps the encoding of later groups."""
    plan, encoded = dispatched.plan, dispatched.encoded
    position = {i: j for j, i in enumerate(dispatched.device_leaves)}
    is_primary = jax.process_index() == req.primary_host
    for i, storage in enumerate(req.storages):
        if storage != "device":
            arr = req.values[i]  # already a handler-owned copy
            shards = {"raw": [(grid.full_box(arr.shape), arr)] if is_primary else []}
            yield _leaf_job(req, i, Exact(), {}, shards, 0.0)
            continue
        out = encoded[position[i]]
        safe, rel_error, side, same = jax.device_get(
            (out["safe"], out["rel_error"], out["side"], out["same"]))
        codec = stored_codec(plan[i], bool(safe), bool(same))
        unit_axes = req.unit_axes.get(i, ())
        if codec is not plan[i]:
            side, rel_error = {}, 0.0
        if isinstance(codec, Same):  # a zero run, no lossless coding
            fields = {"sym": [(box, np.zeros(d.shape, np.uint8))
                              for box, d in _replica0_shards(out["fields"]["raw"])]}
        elif codec is plan[i]:
            fields = {name: [(box, copy.result()) for box, copy in shards]
                      for name, shards in dispatched.copies[position[i]].items()}
        elif isinstance(out["recon"], np.ndarray):  # the guard failed on a host kernel's leaf
            fields = {"raw": [(grid.full_box(out["recon"].shape), out["recon"])]}
        else:  # the guard failed: the exact value, which no copy was started for
            fields = {"raw": [(box, np.asarray(d)) for box, d in _replica0_shards(out["recon"])]}
        shards = {name: grid.split_units(host, unit_axes) for name, host in fields.items()}
        yield _leaf_job(req, i, codec, side, shards, rel_error)


def stored_codec(planned: Codec, safe: bool, same: bool) -> Codec:
    """The codec a device leaf is stored with, from the encode program's flags: ``same`` for
    an ``exact`` leaf bit-identical to its reference; ``exact`` when the planned codec's
    output failed the guard (non-finite input, delta or reconstruction, or a sign-breaking
    reconstruction: stored exactly for this save, never garbage); else the planned one."""
    if same:
        return Same()
    return planned if safe else Exact()


def save_stats(req: SaveRequest, dispatched: Dispatched) -> dict[str, Any]:
    """Base or delta, and per leaf the codec chosen and the relative error measured, from the
    device flags alone (waits for the device programs, not for the files)."""
    flags = jax.device_get([(e["safe"], e["rel_error"], e["same"])
                            for e in dispatched.encoded])
    leaves: dict[str, Any] = {}
    by_position = dict(zip(dispatched.device_leaves, flags, strict=True))
    for i, path in enumerate(req.paths):
        codec: Codec = Exact()
        err = 0.0
        if i in by_position:
            safe, rel_error, same = by_position[i]
            codec = stored_codec(dispatched.plan[i], bool(safe), bool(same))
            if codec is dispatched.plan[i]:
                err = float(rel_error)
        leaves[path_str(path)] = {"codec": codec_config(codec)["id"], "rel_error": err}
    return {"kind": req.header.save_type, "leaves": leaves}


def write_process_files(
    directory: str, process: int, header: Header, jobs: Iterable[LeafJob], is_primary: bool,
    threads: int,
) -> list[LeafJob]:
    """Entropy-code and write this process's pieces and index (runs in the commit thread).

    ``jobs`` may be a generator (:func:`iter_jobs`): the pieces of each job are coded as it
    arrives, and its host buffers are released once its pieces are in the file. Returns the
    jobs (with their shards released).
    """

    def encode(codec: Codec, name: str, local: np.ndarray) -> bytes:
        return codec.host_encode(name, np.ascontiguousarray(local))

    writer = payload.PayloadWriter(os.path.join(directory, payload.data_file_name(process)))
    done: list[LeafJob] = []
    pieces: dict[int, list[dict[str, Any]]] = {}
    pending: dict[int, int] = {}  # job index -> pieces not yet in the file
    # At most `window` coded pieces wait in memory: coding runs on every thread while the
    # pieces are appended in order (the file layout does not depend on the thread count).
    window = 2 * max(threads, 1)

    def append(job: LeafJob, name: str, piece: Any, future: concurrent.futures.Future) -> None:
        pieces[job.index].append(writer.append(name, piece, future.result()).to_msgpack())
        pending[job.index] -= 1
        if not pending[job.index]:
            job.shards = {}  # in the file: release the host buffers

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            in_flight: collections.deque = collections.deque()
            for job in jobs:
                done.append(job)
                pieces[job.index] = []
                codec = job.entry.codec
                field_dtypes = codec.field_dtypes(job.entry.dtype)
                tasks = []
                for name, shards in job.shards.items():
                    if name not in field_dtypes:
                        raise LossyError(f"leaf {job.entry.name}: codec gave unknown field {name}")
                    for box, host in shards:
                        for piece in grid.grid_pieces(box, job.entry.chunk):
                            local = host[grid.local_slices(piece, box)] if piece else host
                            tasks.append((name, piece, local))
                pending[job.index] = len(tasks)
                if not tasks:
                    job.shards = {}
                for name, piece, local in tasks:
                    in_flight.append((job, name, piece, pool.submit(encode, codec, name, local)))
                    if len(in_flight) >= window:
                        append(*in_flight.popleft())
            while in_flight:
                append(*in_flight.popleft())
    finally:
        writer.close()
    body: dict[str, Any] = {
        "process": process,
        "pieces": [[index, plist] for index, plist in pieces.items()],
    }
    if is_primary:
        body["header"] = header.to_msgpack()
        body["leaves"] = [job.entry.to_msgpack(with_pieces=False) for job in done]
    envelope.write_envelope(
        os.path.join(directory, payload.index_file_name(process)), "index", body
    )
    return done


def merge_indexes(directory: str) -> Manifest:
    """Merge the per-process indexes into ``manifest.msgpack`` and remove them."""
    names = sorted(n for n in steps.listdir(directory)
                   if re.fullmatch(r"index\.p\d+\.msgpack", n))
    bodies = [envelope.read_envelope(os.path.join(directory, n), "index") for n in names]
    primaries = [b for b in bodies if "header" in b]
    if len(primaries) != 1:
        raise FormatError(f"{directory}: expected one primary index, found {len(primaries)}")
    primary = primaries[0]
    expected = primary["header"]["process_count"]
    if len(bodies) != expected:
        raise FormatError(f"{directory}: {len(bodies)} of {expected} processes wrote their index")
    leaves = primary["leaves"]
    for leaf in leaves:
        leaf["pieces"] = []
    for body in bodies:
        for index, plist in body["pieces"]:
            leaves[index]["pieces"].extend(plist)
    manifest = Manifest.parse({**primary["header"], "leaves": leaves}, directory)
    write_manifest(directory, manifest)
    for n in names:
        steps.remove(os.path.join(directory, n))
    return manifest

