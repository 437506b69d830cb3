"""The save pipeline: secure inputs (blocking part), then encode and write (commit thread).

0. Training thread (``async_save``): :func:`secure_copies` makes device copies the handler
   owns (dispatched, nothing compiled, nothing waited for) and :func:`make_header` fixes the
   base/delta decision and the dependencies; together they form a :class:`SaveRequest`.
1. :func:`dispatch_encode`: the policy's codec plan and the jitted encode program(s), plus
   the start of the device-to-host copies; :func:`collect` waits for them and returns an
   :class:`EncodedSave` holding host buffers plus the new reference values.
   :func:`encode_save` does both. In one process this runs in the commit thread; with
   several processes the dispatch stays on the training thread (collectives in one order).
2. :func:`write_process_files` (Orbax's commit thread, after the directory exists):
   entropy-code every chunk-grid piece on a thread pool, append the pieces to
   ``data.p<K>.bin`` and write ``index.p<K>.msgpack``.
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
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from orbax_lossy.codecs.base import Codec, codec_config
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.engine import device
from orbax_lossy.engine.reference import Reference, Signature, delta_signature
from orbax_lossy.errors import FormatError, LossyError
from orbax_lossy.format import envelope, grid, payload, steps
from orbax_lossy.format.manifest import (
    MANIFEST_NAME,
    Header,
    LeafEntry,
    Manifest,
    ReferenceLink,
)
from orbax_lossy.format.steps import step_of
from orbax_lossy.policy import Policy, leaf_role
from orbax_lossy.treepaths import StoredPath

HostShards = list[tuple[grid.Box, np.ndarray]]


@dataclasses.dataclass
class LeafJob:
    """One leaf to write: its manifest entry (without pieces) and its host buffers."""

    index: int
    entry: LeafEntry
    shards: dict[str, HostShards]  # field -> replica-0 shards on host


@dataclasses.dataclass
class EncodedSave:
    """What the blocking half of a save hands to the commit thread."""

    jobs: list[LeafJob]
    header: Header
    reconstruction: list[Any]  # per leaf: the next reference value, or None

    def stats(self) -> dict[str, Any]:
        """Base or delta, and per leaf the codec chosen and the relative error measured."""
        return {
            "kind": self.header.save_type,
            "leaves": {job.entry.name: {"codec": job.entry.codec_config["id"],
                                        "rel_error": job.entry.rel_error} for job in self.jobs},
        }


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


def next_reference(request: SaveRequest, signature: Signature, encoded: EncodedSave,
                   on_host: bool) -> Reference:
    """The reference the next save of this item is encoded against: this reconstruction."""
    values = encoded.reconstruction
    if on_host:
        values = [np.asarray(r) if r is not None else None for r in values]
    header = encoded.header
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
        if storage == "device" and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        prepared.append(leaf if storage == "device" else np.asarray(jax.device_get(leaf)))
        key_impls.append(impl)
    return prepared, key_impls


def secure_copies(prepared: Sequence[Any], storages: Sequence[str]) -> list[Any]:
    """Copies of the leaves that the handler owns, so the caller may donate or overwrite its
    arrays as soon as ``save()`` returns.

    A device leaf is copied on its devices by ``jax.device_put(..., may_alias=False)``: an
    asynchronous device-to-device copy per shard that compiles nothing and returns at once
    (JAX orders a later donation of the original after the copy). A host leaf is copied now.
    """
    on_device = [i for i, s in enumerate(storages) if s == "device"]
    # one batched call for every device leaf (per-leaf calls cost ~0.5 ms each in dispatch)
    copies = jax.device_put([prepared[i] for i in on_device],
                            [prepared[i].sharding for i in on_device],
                            may_alias=False, donate=False)
    out = [None if s == "device" else np.array(x, copy=True)
           for x, s in zip(prepared, storages, strict=True)]
    for i, copy in zip(on_device, copies, strict=True):
        out[i] = copy
    return out


def make_header(
    *,
    item_dir: str,
    ref: Reference | None,
    base_interval: int,
    chunk_bytes: int,
    primary_host: int,
    per_leaf: bool,
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
        programs="per_leaf" if per_leaf else "tree",
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
    encoded: list[dict[str, Any]]


def dispatch_encode(req: SaveRequest) -> Dispatched:
    """Choose codecs and dispatch the encode program(s); start the device-to-host copies.

    Compiles on the first call per shapes and plan. Runs the same programs in the same order
    on every process (their reductions are collectives). Does not wait for results, except
    what the policy itself reads (an adaptive policy's statistics).
    """
    prepared, storages, key_impls, ref = req.values, req.storages, req.key_impls, req.ref
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
            refs[i] = r
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
    encoded = device.run_grouped(
        device.encode_tree,
        bool(req.policy.plan_varies),
        [prepared[i] for i in device_leaves],
        [refs[i] for i in device_leaves],
        plan=tuple(plan[i] for i in device_leaves),
        shardings=tuple(prepared[i].sharding for i in device_leaves),
    )
    for out in encoded:
        for arr in out["fields"].values():
            for _, data in _replica0_shards(arr):
                data.copy_to_host_async()
    return Dispatched(plan, device_leaves, encoded)


def collect(req: SaveRequest, dispatched: Dispatched) -> EncodedSave:
    """Wait for the device results and build the leaf jobs (host buffers) of the save."""
    prepared, storages, key_impls, paths = req.values, req.storages, req.key_impls, req.paths
    plan, device_leaves, encoded = dispatched.plan, dispatched.device_leaves, dispatched.encoded
    host_fields: dict[int, dict[str, HostShards]] = {}
    for j, i in enumerate(device_leaves):
        for name, arr in encoded[j]["fields"].items():
            host_fields.setdefault(i, {})[name] = grid.split_units([
                (box, np.asarray(d)) for box, d in _replica0_shards(arr)
            ], req.unit_axes.get(i, ()))
    flags = jax.device_get([(e["safe"], e["rel_error"], e["side"]) for e in encoded])

    def job(i: int, codec: Codec, side: dict, shards: dict[str, HostShards], err: float):
        arr = prepared[i]
        dtype = np.dtype(arr.dtype)
        entry = LeafEntry(
            path=paths[i],
            storage=storages[i],
            shape=tuple(int(d) for d in np.shape(arr)),
            dtype=dtype,
            key_impl=key_impls[i],
            codec_config=codec_config(codec),
            chunk=grid.chunk_shape_for(np.shape(arr), dtype.itemsize, req.chunk_bytes),
            side={k: np.asarray(v) for k, v in side.items()},
            role=("rng" if key_impls[i] is not None else
                  req.roles[i] if req.roles is not None else leaf_role(paths[i], dtype)),
            rel_error=float(err),
            sharding=sharding_string(arr.sharding) if storages[i] == "device" else None,
        )
        return LeafJob(i, entry, shards)

    reconstruction: list[Any] = [None] * len(prepared)
    jobs: list[LeafJob] = []
    is_primary = jax.process_index() == req.primary_host
    for j, i in enumerate(device_leaves):
        safe, rel_error, side = flags[j]
        codec = plan[i]
        reconstruction[i] = encoded[j]["recon"]
        if not bool(safe):
            # Non-finite input, delta or reconstruction, or a sign-breaking reconstruction
            # (device.encode_tree): store this leaf exactly for this save (never garbage).
            codec, side, rel_error = Exact(), {}, 0.0
            host_fields[i] = {"raw": grid.split_units(
                [(box, np.asarray(d)) for box, d in _replica0_shards(encoded[j]["recon"])],
                req.unit_axes.get(i, ()))}
        jobs.append(job(i, codec, side, host_fields.get(i, {}), rel_error))
    for i, storage in enumerate(storages):
        if storage != "device":
            arr = prepared[i]  # already a handler-owned copy
            shards = {"raw": [(grid.full_box(arr.shape), arr)] if is_primary else []}
            jobs.append(job(i, Exact(), {}, shards, 0.0))
    jobs.sort(key=lambda x: x.index)
    return EncodedSave(jobs, req.header, reconstruction)


def encode_save(req: SaveRequest, dispatched: Dispatched | None = None) -> EncodedSave:
    """Dispatch (unless already done) and collect: the whole encode half of a save.

    Then releases the request's inputs (the handler-owned copies and the old reference):
    what the files need is held by the returned jobs, so a commit holds at most the inputs,
    the new reconstruction and the host fields at once.
    """
    encoded = collect(req, dispatched if dispatched is not None else dispatch_encode(req))
    req.values, req.ref = [], None
    return encoded


def _append(writer: payload.PayloadWriter, pieces: dict[int, list[dict[str, Any]]],
            task: tuple, future: concurrent.futures.Future) -> None:
    job, _, name, piece, _ = task
    pieces[job.index].append(writer.append(name, piece, future.result()).to_msgpack())


def write_process_files(
    directory: str, process: int, save: EncodedSave, is_primary: bool, threads: int
) -> None:
    """Entropy-code and write this process's pieces and index (runs in the commit thread)."""
    tasks = []
    for job in save.jobs:
        codec = job.entry.codec
        field_dtypes = codec.field_dtypes(job.entry.dtype)
        for name, shards in job.shards.items():
            if name not in field_dtypes:
                raise LossyError(f"leaf {job.entry.name}: codec gave unknown field {name}")
            for box, host in shards:
                for piece in grid.grid_pieces(box, job.entry.chunk):
                    local = host[grid.local_slices(piece, box)] if piece else host
                    tasks.append((job, codec, name, piece, local))

    def encode(task: tuple) -> bytes:
        _, codec, name, _, local = task
        return codec.host_encode(name, np.ascontiguousarray(local))

    writer = payload.PayloadWriter(os.path.join(directory, payload.data_file_name(process)))
    pieces: dict[int, list[dict[str, Any]]] = {job.index: [] for job in save.jobs}
    # At most `window` coded pieces wait in memory: coding runs on every thread while the
    # pieces are appended in order (the file layout does not depend on the thread count).
    window = 2 * max(threads, 1)
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            in_flight: collections.deque = collections.deque()
            for task in tasks:
                in_flight.append((task, pool.submit(encode, task)))
                if len(in_flight) >= window:
                    _append(writer, pieces, *in_flight.popleft())
            while in_flight:
                _append(writer, pieces, *in_flight.popleft())
    finally:
        writer.close()
    body: dict[str, Any] = {
        "process": process,
        "pieces": [[index, plist] for index, plist in pieces.items()],
    }
    if is_primary:
        body["header"] = save.header.to_msgpack()
        body["leaves"] = [job.entry.to_msgpack(with_pieces=False) for job in save.jobs]
    envelope.write_envelope(
        os.path.join(directory, payload.index_file_name(process)), "index", body
    )


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
    envelope.write_envelope(
        os.path.join(directory, MANIFEST_NAME), "manifest", manifest.to_msgpack()
    )
    for n in names:
        steps.remove(os.path.join(directory, n))
    return manifest

