"""The restore pipeline: walk the chain, match targets, read only needed pieces, decode.

Each selected leaf is read from the newest link that stores it without a reference (an
exact leaf from the newest step alone), then the later links' deltas are decoded on device,
window by window of consecutive links and leaf by leaf, one jitted program per leaf and
window. Leaves are matched across links by path, and each link must agree on the leaf's
shape, dtype, storage and key type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Collection, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import work_dtype
from orbax_lossy.engine import device, precompile, reading, transfer
from orbax_lossy.errors import ChainError, FormatError, InvalidArgumentError, LossyError
from orbax_lossy.format import payload
from orbax_lossy.format.chain import walk_chain
from orbax_lossy.format.manifest import HOST_STORAGES, LeafEntry, Manifest
from orbax_lossy.format.steps import abspath, root_of
from orbax_lossy.treepaths import StoredPath, build_nested, empty_value, flatten, path_str

T = TypeVar("T")
PLACEHOLDER = ...  # ocp.PLACEHOLDER: a target leaf that is not restored

#: what decoding damaged (but checksum-valid or CRC-recomputed) data can raise besides our
#: own errors; at the boundary of decoding stored data these become FormatErrors with context
_DAMAGE = (TypeError, ValueError, KeyError, IndexError, MemoryError, AssertionError,
           OverflowError, ZeroDivisionError, AttributeError, RecursionError, RuntimeError)
#: environment variable: the most bytes one restore may allocate in this process
MAX_RESTORE_BYTES_ENV = "ORBAX_LOSSY_MAX_RESTORE_BYTES"


@contextlib.contextmanager
def stored_data(where: str) -> Iterator[None]:
    """Turn a stray exception raised while decoding stored data into a FormatError.

    ``where`` names the file, step and leaf. LossyErrors pass unchanged; the original
    exception is chained (``raise ... from``), so a genuine bug stays visible.
    """
    try:
        yield
    except LossyError:
        raise
    except _DAMAGE as e:
        raise FormatError(f"{where}: stored data does not decode "
                          f"({type(e).__name__}: {str(e)[:300]})") from e
    except Exception as e:
        if type(e).__name__ in ("XlaRuntimeError", "JaxRuntimeError"):
            raise FormatError(f"{where}: stored data does not decode ({str(e)[:300]})") from e
        raise


def _where(link_dir: str, manifest: Manifest, leaf: str | None = None) -> str:
    out = f"{link_dir} (step {manifest.header.step})"
    return out if leaf is None else f"{out}: leaf {leaf!r}"


def memory_budget() -> int:
    """The most bytes a restore may allocate here: ``ORBAX_LOSSY_MAX_RESTORE_BYTES``, else
    this machine's physical memory plus the memory of its local accelerators."""
    env = os.environ.get(MAX_RESTORE_BYTES_ENV)
    if env:
        return int(env)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        host = 1 << 40
    accel = 0
    for d in jax.local_devices():
        if d.platform != "cpu":
            with contextlib.suppress(Exception):
                accel += int((d.memory_stats() or {}).get("bytes_limit", 0))
    return host + accel


def _check_budget(item_dir: str, manifest: Manifest, leaves: Sequence[LeafEntry],
                  targets: Sequence[Any]) -> None:
    """Refuse, before allocating, a restore claiming more memory than this process has.

    Counts the values this process holds (its addressable shards of device leaves, whole
    host leaves) and their largest codec fields: a manifest that claims 2**40 elements fails
    here, not in the allocator.
    """
    total, largest, name = 0, 0, ""
    for leaf, target in zip(leaves, targets, strict=True):
        elements = math.prod(leaf.shape)
        if leaf.storage == "device" and elements:
            sharding = reading.target_sharding(target)
            with stored_data(_where(item_dir, manifest, leaf.name)):
                regions = _region_keys(sharding, leaf.shape)
                elements = sum(math.prod(stop - start for start, stop in r) for r in regions)
        width = leaf.dtype.itemsize + sum(
            d.itemsize for d in leaf.codec.field_dtypes(leaf.dtype).values())
        need = elements * width
        total += need
        if need > largest:
            largest, name = need, leaf.name
    budget = memory_budget()
    if total > budget:
        raise FormatError(
            f"{_where(item_dir, manifest)}: restoring it would allocate {total} bytes (largest "
            f"leaf {name!r}: {largest}), more than this machine's memory ({budget}); the manifest "
            f"is damaged, or set {MAX_RESTORE_BYTES_ENV} to allow it"
        )


def _region_keys(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> set:
    from orbax_lossy.format import grid

    return {grid.box_from_index(idx or (), shape)
            for idx in sharding.addressable_devices_indices_map(shape).values()}


@functools.lru_cache(maxsize=4096)
def _side_spec(codec: Any, shape: tuple[int, ...], dtype: np.dtype) -> dict[str, tuple]:
    """``{name: (shape, dtype)}`` of the side arrays the codec writes for such a leaf: what
    the codec declares (:meth:`side_shapes`) where the leaf works in float32, else what
    tracing its encode gives."""
    if codec.codec_id == "exact":
        return {}
    declared = getattr(codec, "side_shapes", None)  # a plugin codec may not declare them
    shapes = declared() if declared is not None else None
    if shapes is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(
            work_dtype(dtype)) == jnp.float32:
        return {k: (tuple(v), np.dtype(np.float32)) for k, v in shapes.items()}
    return traced_side_spec(codec, shape, dtype)


def traced_side_spec(codec: Any, shape: tuple[int, ...], dtype: np.dtype) -> dict[str, tuple]:
    """``{name: (shape, dtype)}`` of the side arrays of ``codec``'s encode, traced."""
    value = jax.ShapeDtypeStruct(shape, dtype)
    ref = value if codec.needs_reference else None
    side = jax.eval_shape(lambda v, r: codec.device_encode(v, r).side, value, ref)
    return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in side.items()}


#: side arrays of the current codecs depend on the codec and the dtype only: they are traced
#: once on this shape (then on the leaf's own shape only when that does not match)
_PROBE_SHAPE = (16,)


def _check_side(leaf: LeafEntry, where: str) -> None:
    """The stored side arrays are exactly those the codec writes (names, shapes, dtypes).

    Without this, a shorter codebook would be indexed out of bounds on device, where JAX clamps
    indices silently.
    """
    got = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in leaf.side.items()}
    codec: Any = leaf.codec  # codecs are frozen, hashable dataclasses
    expected = None
    with contextlib.suppress(Exception):
        expected = _side_spec(codec, _PROBE_SHAPE, leaf.dtype)
    if got == expected:
        return
    with stored_data(where):
        expected = _side_spec(codec, leaf.shape, leaf.dtype)
    if got != expected:
        raise FormatError(f"{where}: side arrays {got} are not the {expected} its codec "
                          f"{leaf.codec_config.get('id')!r} writes")


@dataclasses.dataclass
class RestoredItem:
    """A restored tree, and what the handler needs to adopt it as its reference."""

    tree: Any
    item_dir: str
    manifest: Manifest
    values: list[Any]  # per stored leaf (None where not selected), before casting
    complete: bool  # every stored leaf was restored
    bytes_read: int


def _same_leaf(a: LeafEntry, b: LeafEntry) -> bool:
    return (a.shape, a.dtype, a.storage, a.key_impl) == (b.shape, b.dtype, b.storage, b.key_impl)


def _link_leaves(
    chain: list[tuple[str, Manifest]], selected: Sequence[LeafEntry],
    loose: Collection[str] = (),
) -> list[list[LeafEntry]]:
    """Per link, the entries of the selected leaves (matched by path, checked alike).

    Every link of a chain stores the same leaf paths (a save whose tree changed is a base),
    so a leaf added to or removed from one link is refused here; leaves named in ``loose``
    (partial experts' slots, which a save may store under another name) are left out of that
    comparison (never out of the selected leaves' checks).
    """
    out = []
    final_dir, final = chain[-1]

    def kept(manifest: Manifest) -> set[Any]:
        return {p for p in manifest.index if path_str(p) not in loose}

    for link_dir, manifest in chain:
        if manifest is not final and kept(manifest) != kept(final):
            extra = sorted(path_str(p) for p in kept(manifest) ^ kept(final))
            raise ChainError(f"{link_dir} (step {manifest.header.step}) and {final_dir} "
                             f"(step {final.header.step}) store different leaves "
                             f"({', '.join(extra[:5])}); the chain is inconsistent")
        entries = []
        for leaf in selected:
            j = manifest.index.get(leaf.path)
            if j is None:
                raise ChainError(f"{link_dir}: leaf {leaf.name!r} of the restored step is "
                                 "missing from this link of its chain")
            entry = manifest.leaves[j]
            if not _same_leaf(entry, leaf):
                raise ChainError(
                    f"{link_dir}: leaf {leaf.name!r} is {entry.storage} {entry.dtype} "
                    f"{entry.shape} here but {leaf.storage} {leaf.dtype} {leaf.shape} in the "
                    "restored step; the chain is inconsistent"
                )
            entries.append(entry)
        out.append(entries)
    return out


def _first_needed_links(per_link: list[list[LeafEntry]], n: int) -> list[int]:
    """Per selected leaf, the last link that stores it without a reference."""
    starts = [0] * n
    for position, entries in enumerate(per_link):
        for k, entry in enumerate(entries):
            if not entry.codec.needs_reference:
                starts[k] = position
    return starts


def _needed_links(per_link: list[list[LeafEntry]], n: int) -> list[tuple[int, list[bool]]]:
    """Per chain link a restore reads: its position and which selected leaves it decodes
    (those stored whole in it or in an earlier link since their last whole copy)."""
    starts = _first_needed_links(per_link, n)
    out = []
    for position in range(len(per_link)):
        active = [position >= start for start in starts]
        if any(active):
            out.append((position, active))
    return out


def _match_targets(
    item_dir: str, manifest: Manifest, target: Any
) -> tuple[list[int | None], list[Any], Any]:
    """Per target leaf, the stored leaf it takes (None for ``ocp.PLACEHOLDER``: skipped), the
    target leaves and the target treedef (None: no target, every stored leaf, nested dicts)."""
    if target is None:
        return list(range(len(manifest.leaves))), [None] * len(manifest.leaves), None
    paths, leaves, treedef = flatten(target)
    by_name: dict[str, int | None] = {}
    for j, leaf in enumerate(manifest.leaves):
        by_name[leaf.name] = None if leaf.name in by_name else j  # None: ambiguous
    selected: list[int | None] = []
    for p, leaf in zip(paths, leaves, strict=True):
        if leaf is PLACEHOLDER:
            selected.append(None)
            continue
        i: int | None = manifest.index.get(p)
        if i is None:
            i = by_name.get(path_str(p))  # dict keys and attributes alike, as Orbax does
        if i is None:
            raise InvalidArgumentError(
                f"restore target leaf {path_str(p)!r} is not in checkpoint {item_dir}"
            )
        selected.append(i)
    for p, leaf, i in zip(paths, leaves, selected, strict=True):
        if i is None:
            continue
        stored = manifest.leaves[i].shape
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
                f"in {item_dir} (the lossy handler neither pads nor truncates)"
            )
    return selected, leaves, treedef


def _check_complete(item_dir: str, manifest: Manifest, target: Any,
                    matched: list[int | None]) -> None:
    """Raise unless ``target`` takes (or skips as ``PLACEHOLDER``) every stored leaf, as
    Orbax does without ``partial_restore``; ``None`` leaves never count as missing."""
    paths, leaves, _ = flatten(target)
    skipped = {path_str(p) for p, leaf in zip(paths, leaves, strict=True) if leaf is PLACEHOLDER}
    taken = set(matched)
    missing = [leaf.name for j, leaf in enumerate(manifest.leaves)
               if j not in taken and leaf.name not in skipped and leaf.storage != "none"]
    if missing:
        raise InvalidArgumentError(
            f"the restore target lacks {len(missing)} stored leaves of {item_dir} "
            f"(e.g. {missing[:3]}); pass LossyRestore(..., partial_restore=True) to restore "
            "only the target's leaves"
        )


@dataclasses.dataclass
class _Link:
    """One chain link to decode: its files, entries, which leaves it decodes, and the piece
    decodes already submitted for it (per (leaf, field))."""

    link_dir: str
    manifest: Manifest
    entries: list[LeafEntry]
    active: list[bool]
    reader: payload.PayloadReader
    started: dict[tuple[int, str], reading.FieldRead] = dataclasses.field(default_factory=dict)
    #: per device leaf: (where, pieces by field, field dtypes), computed once for
    #: :func:`_start_leaf`, :func:`_started_reads` and :func:`_read_leaf` (thousands of leaves
    #: and links)
    layouts: dict[int, tuple[str, dict[str, list], dict[str, np.dtype]]] = dataclasses.field(
        default_factory=dict)

    def layout(self, k: int) -> tuple[str, dict[str, list], dict[str, np.dtype]]:
        """Where device leaf ``k`` of this link is (for errors), its pieces by field and its
        fields' dtypes."""
        out = self.layouts.get(k)
        if out is None:
            leaf = self.entries[k]
            out = self.layouts[k] = (_where(self.link_dir, self.manifest, leaf.name),
                                     reading.pieces_by_field(leaf.pieces),
                                     leaf.codec.field_dtypes(leaf.dtype))
        return out


def _start_leaf(link: _Link, k: int, sharding: jax.sharding.Sharding, threads: int,
                take: reading.Take) -> None:
    """Submit the entropy decoding of every piece that device leaf ``k`` of the link needs
    on ``sharding`` (its uint8 fields into arrays from ``take``), so that it runs while the
    leaf before it is still being decoded (see :func:`_decode_windows`)."""
    leaf = link.entries[k]
    lw, by_field, dtypes = link.layout(k)
    for name, fdtype in dtypes.items():
        with stored_data(lw):
            link.started[(k, name)] = reading.start_field(
                link.reader, by_field.get(name, []), leaf.codec, name, fdtype, leaf.shape,
                sharding, lw, threads, ahead=True, take=take)


@dataclasses.dataclass
class _LeafRead:
    """One link's stored fields of one device leaf, uploaded and ready to decode."""

    codec: Any
    fields: dict[str, jax.Array | np.ndarray]  # host arrays where transfer.passes_as_host
    side: dict[str, np.ndarray]
    where: str


def _read_host_leaves(link: _Link, values: list[Any]) -> None:
    """Read the link's host leaves into ``values`` (a later link stores none of them)."""
    for k, leaf in enumerate(link.entries):
        if link.active[k] and leaf.storage in HOST_STORAGES:
            lw = _where(link.link_dir, link.manifest, leaf.name)
            with stored_data(lw):
                values[k] = reading.read_region(
                    link.reader, leaf.pieces, leaf.codec, "raw", leaf.dtype,
                    tuple((0, d) for d in leaf.shape), lw,
                )


def _read_leaf(link: _Link, k: int, sharding: jax.sharding.Sharding, host: bool,
               threads: int) -> _LeafRead:
    """The link's stored fields of device leaf ``k`` on ``sharding`` (their decoding started
    by :func:`_start_leaf`), ready for its decode program; ``host``: fields come as their
    host arrays where they can (:func:`transfer.passes_as_host` of ``sharding``)."""
    leaf = link.entries[k]
    lw, by_field, dtypes = link.layout(k)
    codec = leaf.codec
    _check_side(leaf, lw)
    with stored_data(lw):
        fields = {
            name: reading.assemble_field(
                link.reader, by_field.get(name, []), codec, name, fdtype, leaf.shape,
                sharding, lw, threads, link.started.pop((k, name), None), host=host,
            )
            for name, fdtype in dtypes.items()
        }
    # side arrays stay numpy: the program's call transfers them at once
    return _LeafRead(codec, fields, dict(leaf.side), lw)


def _program_key(codecs: Sequence[Any], sides: Sequence[dict[str, Any]], leaf: LeafEntry,
                 sharding: jax.sharding.Sharding, referenced: bool) -> tuple:
    """What tells one leaf's decode program of a window from another (its compiled program
    is the same for the same key). Side arrays are numpy arrays (or jax.Arrays): their
    ``shape`` is a tuple and their ``dtype`` a numpy dtype already."""
    return (tuple(codecs), leaf.dtype, leaf.shape, sharding, referenced,
            tuple([tuple([(k, v.shape, v.dtype) for k, v in side.items()]) for side in sides]))


def _from_last_whole(items: list[T], codecs: list[Any]) -> tuple[list[T], bool]:
    """``items`` from the last one whose codec stores the leaf whole (the links before it
    are not needed), and whether the first kept one needs a reference."""
    whole = [j for j, c in enumerate(codecs) if not c.needs_reference]
    if whole:
        return items[whole[-1]:], False
    return items, True


def _as_is(codecs: Sequence[Any], leaf: LeafEntry, sharding: jax.sharding.Sharding,
           referenced: bool) -> bool:
    """Whether a window's decode of this leaf is its one ``exact`` link's host array itself,
    no program: on one CPU device (:func:`transfer.passes_as_host`), where JAX's device
    array aliases the aligned array that the piece decoded into (a program made a second
    copy in fresh memory: its page faults were 42% of the CPU time of a 64 MB base's
    restore). Donating such an array to a later program is safe (XLA leaves the memory it
    did not allocate alone and writes its result elsewhere), as for plain Orbax's restored
    arrays on CPU."""
    return (not referenced and len(codecs) == 1 and codecs[0].codec_id == "exact"
            and jax.dtypes.canonicalize_dtype(leaf.dtype) == leaf.dtype
            and transfer.passes_as_host(sharding))


def _precompile(links: Sequence[Any], windows: Sequence[range], chosen: Sequence[LeafEntry],
                targets: Sequence[Any], speculative: bool = False) -> None:
    """Submit the decode programs of every window and device leaf this process has not
    compiled yet (:mod:`~orbax_lossy.engine.precompile`), in the order they will run; a
    restore's own call (not ``speculative``) first cancels speculative programs it does not
    need and that have not started."""
    keys: list[tuple[tuple, Any]] = []
    for window in windows:
        for k, leaf in enumerate(chosen):
            if leaf.storage != "device":
                continue
            stored = [links[n].entries[k] for n in window if links[n].active[k]]
            entries, referenced = _from_last_whole(stored, [e.codec for e in stored])
            if not entries:
                continue
            codecs = tuple(e.codec for e in entries)
            sharding = reading.target_sharding(targets[k])
            if _as_is(codecs, leaf, sharding, referenced):
                continue
            sides = [dict(e.side) for e in entries]
            key = _program_key(codecs, sides, leaf, sharding, referenced)

            def compile_program(codecs=codecs, sides=sides, leaf=leaf, sharding=sharding,
                                referenced=referenced) -> object:
                def spec(shape, dtype, on=None):
                    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=on)

                # fields that reach the program as host arrays are uncommitted arguments
                on = None if transfer.passes_as_host(sharding) else sharding
                fields = tuple({name: spec(leaf.shape, dtype, on) for name, dtype in
                                codec.field_dtypes(leaf.dtype).items()} for codec in codecs)
                side_specs = tuple({name: spec(v.shape, v.dtype) for name, v in side.items()}
                                   for side in sides)
                reference = spec(leaf.shape, leaf.dtype, sharding) if referenced else None
                return device.decode_links_program(sharding).lower(
                    fields, side_specs, reference, plans=codecs, dtype=leaf.dtype).compile()

            keys.append((key, compile_program))
    if not speculative:
        precompile.keep_only({key for key, _ in keys})
    for key, compile_program in keys:
        precompile.submit(key, compile_program, speculative)


def _decode_leaf(stored: list[_LeafRead], leaf: LeafEntry, sharding: jax.sharding.Sharding,
                 values: list[Any], k: int) -> None:
    """Decode one device leaf through a window of consecutive links into ``values[k]``: one
    program that applies the window's links in chain order (:func:`device.decode_links`), so
    the leaf is read and written once per window, not once per link."""
    reads, referenced = _from_last_whole(stored, [r.codec for r in stored])
    reference = None
    if referenced:
        reference = values[k]
        if reference is None:
            raise ChainError(f"{reads[0].where}: a delta leaf has no reference (chain "
                             "starts here)")
    where = reads[-1].where if len(reads) == 1 else (
        f"{reads[0].where} (decoding it with the {len(reads) - 1} links after it)")
    codecs = tuple(r.codec for r in reads)
    sides = tuple(r.side for r in reads)
    raw = reads[0].fields.get("raw")
    if (_as_is(codecs, leaf, sharding, referenced) and isinstance(raw, np.ndarray)
            and raw.dtype == leaf.dtype and raw.shape == leaf.shape):
        values[k] = jax.device_put(raw, sharding)
        return
    compiled = precompile.wait(_program_key(codecs, sides, leaf, sharding, referenced))
    with stored_data(where):
        values[k] = device.decode_links(
            tuple(r.fields for r in reads), sides, reference, plans=codecs,
            dtype=leaf.dtype, sharding=sharding, compiled=compiled)


#: a restore decodes a chain's links in windows of consecutive links, leaf by leaf (one
#: program per leaf and window, :func:`_decode_leaf`; a 64 MB state's 9 LC links: 52 ms of
#: decode programs link by link, 25 ms in one window): at most this many links per window
#: (a window that ends at the newest link; the oldest window takes the base and the rest):
#: 10, so that the longest chain of the default ``base_interval`` (a base and 9 deltas)
#: decodes in one window, one job per leaf (a 360-leaf 64 MB LC restore: medians 497-504 ->
#: 454 ms against a window of the base and one of the 9 deltas) ...
MAX_WINDOW_LINKS = 10
#: ... whose fields of one leaf hold at most this fraction of the restored device leaves'
#: bytes: the fields of the next two leaves decode while a leaf's program runs, so the
#: fields of three leaves stay within the one reference copy the memory bound allows beyond
#: plain Orbax (the leaf-major order, against windows of whole links: docs/performance.md) ...
WINDOW_FRACTION = 1 / 3
#: restored states below this many device bytes decode link by link: fusing saves them
#: little, and every chain length would compile another program for its oldest window (a
#: process restoring the 7 steps of a small chain compiled 23 programs fused, 11 link by link)
FUSE_MIN_BYTES = 32 << 20


def _window_links(links: Sequence[Any]) -> int:
    """How many delta links a window holds: as many as fit the budget, by the largest
    device field bytes one link stores of one leaf that needs a reference (1 to
    :data:`MAX_WINDOW_LINKS`; 1 below :data:`FUSE_MIN_BYTES`)."""
    state, largest = 0, 0
    for n, link in enumerate(links):
        for active, leaf in zip(link.active, link.entries, strict=True):
            if leaf.storage != "device":
                continue
            elements = math.prod(leaf.shape)
            if n == len(links) - 1:
                state += elements * leaf.dtype.itemsize
            if active and leaf.codec.needs_reference:
                largest = max(largest, elements * sum(
                    d.itemsize for d in leaf.codec.field_dtypes(leaf.dtype).values()))
    if state < FUSE_MIN_BYTES:
        return 1
    return max(1, min(MAX_WINDOW_LINKS, int(state * WINDOW_FRACTION) // max(largest, 1)))


def _windows(count: int, size: int) -> list[range]:
    """Link positions ``0 .. count - 1`` cut into windows of ``size`` that end at the newest
    link; the oldest window (with the base) holds the rest. So a chain of any length decodes
    with the programs of windows of ``size`` links and one more."""
    first = (count - 1) % size + 1 if count else 0
    return [range(0, first)] + [range(s, s + size) for s in range(first, count, size)]


@dataclasses.dataclass
class _LinkPlan:
    """The entries of one chain link and which of them a restore reads (no files)."""

    entries: list[LeafEntry]
    active: list[bool]


def compile_ahead(item_dir: os.PathLike | str) -> None:
    """Submit the decode programs that restoring every leaf of ``item_dir`` onto its saved
    shardings (else the default device) will call, to the compile workers
    (:mod:`~orbax_lossy.engine.precompile`); reads the chain's manifests only. Raises what
    reading them raises (the caller ignores it: the restore itself reports it)."""
    chain = walk_chain(abspath(item_dir))
    chosen = list(chain[-1][1].leaves)
    targets = [reading.with_saved_sharding(None, leaf) for leaf in chosen]
    # every name loose: the restore itself checks that the links store the same leaves
    per_link = _link_leaves(chain, chosen, frozenset(leaf.name for leaf in chosen))
    plans = [_LinkPlan(per_link[position], active)
             for position, active in _needed_links(per_link, len(chosen))]
    _precompile(plans, _windows(len(plans), _window_links(plans)), chosen, targets,
                speculative=True)


def _started_reads(links: list[_Link], window: range, k: int) -> list[reading.FieldRead]:
    """The piece decodes :func:`_start_leaf` submitted for device leaf ``k`` in ``window``."""
    out = []
    for n in window:
        if links[n].active[k]:
            for name in links[n].layout(k)[2]:
                read = links[n].started.get((k, name))
                if read is not None:
                    out.append(read)
    return out


def _decode_windows(links: list[_Link], windows: list[range], chosen: list[LeafEntry],
                    targets: list[Any], values: list[Any], threads: int) -> None:
    """Read and decode the links window by window, and in a window leaf by leaf, into
    ``values`` (see :func:`restore_item`). While a leaf's program runs, the next leaf's
    pieces decode (of this window or the next: small pieces on this thread, the others on
    the piece pool, started two leaves ahead); the uint8 arrays of a leaf serve later leaves
    once its program has run. So the fields in memory are those of at most three leaves of
    a window, not two windows' links of every leaf, and a window may hold more links (fewer
    passes over the state), in arrays that are warm when reused."""
    buffers = reading.HostBuffers()
    shardings = [reading.target_sharding(t) for t in targets]
    hosts = [transfer.passes_as_host(sharding) for sharding in shardings]
    jobs = [(number, k) for number, window in enumerate(windows) for k, leaf in enumerate(chosen)
            if leaf.storage not in HOST_STORAGES and any(links[n].active[k] for n in window)]

    def start(j: int) -> None:
        if j < len(jobs):
            number, k = jobs[j]
            for n in windows[number]:
                if links[n].active[k]:
                    _start_leaf(links[n], k, shardings[k], threads, buffers.lender(j))

    def started_reads(j: int) -> list[reading.FieldRead]:
        if j >= len(jobs):
            return []
        number, k = jobs[j]
        return _started_reads(links, windows[number], k)

    def recycle(j: int) -> None:
        """Lend job ``j``'s arrays again once its program has run: its leaf's value now (the
        job's output, or a later window's program that took it) is the only one that can be
        one of them (a program returning its input unchanged), and is ready only after it."""
        k = jobs[j][1]
        jax.block_until_ready(values[k])
        buffers.recycle([j], [values[k]])

    start(0)
    start(1)
    j = 0
    for number, window in enumerate(windows):
        for n in window:
            _read_host_leaves(links[n], values)
        while j < len(jobs) and jobs[j][0] == number:
            k = jobs[j][1]
            # this leaf's small pieces and the next leaf's (started too), in one call: a
            # window of one link (the base, or a state under FUSE_MIN_BYTES) has one or two
            # pieces a leaf
            reading.decode_together([*started_reads(j), *started_reads(j + 1)])
            stored = [_read_leaf(links[n], k, shardings[k], hosts[k], threads)
                      for n in window if links[n].active[k]]
            _decode_leaf(stored, chosen[k], shardings[k], values, k)
            del stored
            if j:  # (its program ran while this leaf's fields were read)
                recycle(j - 1)
            j += 1
            start(j + 1)
        for n in window:
            links[n].reader.close()


def restore_item(item_dir: os.PathLike | str, target: Any, threads: int,
                 partial: bool = True, loose: Collection[str] = ()) -> RestoredItem:
    """Restore one item directory onto ``target`` (a tree, or None for nested dicts); with
    ``partial=False`` the target must take (or skip) every stored leaf. ``loose``: leaf names
    the links of the chain may store or not (see :func:`_link_leaves`)."""
    item_dir = abspath(item_dir)
    with stored_data(item_dir):
        chain = walk_chain(item_dir)
    final = chain[-1][1]
    matched, all_targets, treedef = _match_targets(item_dir, final, target)
    if target is not None and not partial:
        _check_complete(item_dir, final, target, matched)
    selected = [i for i in matched if i is not None]  # PLACEHOLDER targets are skipped
    chosen = [final.leaves[i] for i in selected]
    targets = [reading.with_saved_sharding(t, leaf) for t, leaf in zip(
        (t for i, t in zip(matched, all_targets, strict=True) if i is not None), chosen,
        strict=True)]
    _check_budget(item_dir, final, chosen, targets)
    per_link = _link_leaves(chain, chosen, frozenset(loose))
    values: list[Any] = [None] * len(chosen)
    root = root_of(item_dir)
    links = []
    for position, active in _needed_links(per_link, len(chosen)):
        link_dir, manifest = chain[position]
        links.append(_Link(link_dir, manifest, per_link[position], active,
                           payload.PayloadReader(link_dir, root)))
    windows = _windows(len(links), _window_links(links))
    _precompile(links, windows, chosen, targets)
    try:
        _decode_windows(links, windows, chosen, targets, values, threads)
    except BaseException:
        for link in links:  # links decoding ahead of the failure: drop their queued pieces
            for started in link.started.values():
                started.cancel()
            link.started.clear()
            link.reader.close()
        raise
    bytes_read = sum(link.reader.bytes_read for link in links)
    out = []
    final_dir = chain[-1][0]
    for k, leaf in enumerate(chosen):
        value = values[k]
        with stored_data(_where(final_dir, final, leaf.name)):
            if leaf.key_impl:
                value = jax.random.wrap_key_data(value, impl=leaf.key_impl)
            out.append(reading.cast_to_target(value, targets[k], leaf))
    if treedef is None:
        empties = final.header.empty_nodes
        with stored_data(_where(final_dir, final)):
            tree = build_nested([leaf.path for leaf in chosen] + [p for p, _ in empties],
                                out + [empty_value(container) for _, container in empties])
    else:
        restored = iter(out)
        tree = jax.tree_util.tree_unflatten(
            treedef, [PLACEHOLDER if i is None else next(restored) for i in matched])
    by_stored: list[Any] = [None] * len(final.leaves)
    for k, i in enumerate(selected):
        by_stored[i] = values[k]
    needed = {i for i, leaf in enumerate(final.leaves) if leaf.storage != "none"}
    return RestoredItem(tree, item_dir, final, by_stored, needed <= set(selected), bytes_read)


def metadata_tree(manifest: Manifest, directory: os.PathLike | str) -> Any:
    """Orbax's tree metadata of a saved item: per leaf an ``ArrayMetadata`` (device and numpy
    leaves: shape, dtype, saved sharding; PRNG keys with their key dtype) or a
    ``ScalarMetadata`` (Python and numpy scalars); no payload is read."""
    from etils import epath
    from orbax.checkpoint import metadata as ocp_metadata
    from orbax.checkpoint._src.metadata import sharding as sharding_metadata
    from orbax.checkpoint._src.metadata import tree as tree_metadata

    where = epath.Path(os.fspath(directory))
    leaves: list[Any] = []
    for leaf in manifest.leaves:
        if leaf.storage == "none":
            leaves.append(None)
            continue
        shape, dtype = leaf.shape, leaf.dtype
        if leaf.key_impl:
            spec = jax.eval_shape(
                lambda s=leaf.shape, d=leaf.dtype, impl=leaf.key_impl:
                jax.random.wrap_key_data(jnp.zeros(s, d), impl=impl))
            shape, dtype = spec.shape, spec.dtype
        sharding = None
        if leaf.sharding is not None:
            with contextlib.suppress(Exception):  # unreadable: reported as unknown
                sharding = sharding_metadata.from_serialized_string(leaf.sharding)
        scalar = leaf.storage in ("int", "float", "bool", "scalar")
        metadata_cls = ocp_metadata.ScalarMetadata if scalar else ocp_metadata.ArrayMetadata
        leaves.append(metadata_cls(name=leaf.name, directory=where, shape=shape, sharding=sharding,
                           dtype=dtype))
    paths: list[StoredPath] = [leaf.path for leaf in manifest.leaves]
    return tree_metadata.build_default_tree_metadata(build_nested(paths, leaves))
