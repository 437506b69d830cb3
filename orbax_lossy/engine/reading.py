"""Reading stored pieces back: regions of a field, and whole fields on a target sharding."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from orbax_lossy.engine import transfer
from orbax_lossy.engine.targets import LeafTarget
from orbax_lossy.entropy.stream import (
    aligned_empty,
    blocks_on_this_thread,
    decode_into,
    decode_symbols_many,
)
from orbax_lossy.errors import FormatError, InvalidArgumentError, LossyError
from orbax_lossy.format import grid
from orbax_lossy.format.manifest import LeafEntry


def target_sharding(target: Any) -> jax.sharding.Sharding:
    """The sharding a restored device leaf takes (the target's, else a default)."""
    sharding = getattr(target, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    if jax.process_count() == 1:
        return jax.sharding.make_single_device_sharding(jax.local_devices()[0])
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@functools.lru_cache(maxsize=256)
def saved_sharding(serialized: str) -> jax.sharding.Sharding | None:
    """The sharding a leaf was saved with, if its devices exist here (else None)."""
    from orbax.checkpoint._src.metadata import sharding as sharding_metadata

    try:
        sharding = sharding_metadata.from_serialized_string(serialized).to_jax_sharding()
        available = set(jax.devices())
        return sharding if all(d in available for d in sharding.device_set) else None
    except Exception:  # other devices, another topology: restored on a default sharding
        return None


def with_saved_sharding(target: Any, leaf: LeafEntry) -> Any:
    """``target``, or a target on the leaf's saved sharding where ``target`` names none."""
    if leaf.storage != "device" or leaf.sharding is None:
        return target
    if isinstance(getattr(target, "sharding", None), jax.sharding.Sharding):
        return target
    sharding = saved_sharding(leaf.sharding)
    if sharding is None:
        return target
    if target is None:
        return LeafTarget(sharding=sharding)
    if isinstance(target, LeafTarget):
        return dataclasses.replace(target, sharding=sharding)
    if isinstance(target, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=sharding)
    return target


def cast_to_target(value: Any, target: Any, leaf: LeafEntry) -> Any:
    """The restored value in the form the target (or the saved leaf) asks for."""
    storage = leaf.storage
    if storage == "none":
        return None
    if storage == "scalar":  # a numpy scalar comes back as one, of its saved dtype
        return np.asarray(value)[()]
    if storage == "int":
        return int(value)
    if storage == "float":
        return float(value)
    if storage == "bool":
        return bool(value)
    dtype = getattr(target, "dtype", None)
    if dtype is not None and storage in ("device", "numpy") and not leaf.key_impl:
        value = _cast(value, np.dtype(dtype), leaf)
    as_numpy = getattr(target, "as_numpy", False) or isinstance(target, np.ndarray)
    if as_numpy:
        return np.asarray(value)
    if storage == "numpy" and (
        isinstance(target, jax.Array | jax.ShapeDtypeStruct)
        or getattr(target, "sharding", None) is not None
    ):
        on_device = jax.device_put(value, target_sharding(target))
        if on_device.dtype != value.dtype:
            raise _narrowed(leaf, value.dtype)
        return on_device
    return value


def _narrowed(leaf: LeafEntry, dtype: np.dtype) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"leaf {leaf.name!r}: restoring {dtype} as a jax.Array would narrow it (JAX 64-bit "
        "mode is off); enable it (jax.config.update('jax_enable_x64', True)) or restore the "
        "leaf as numpy (a numpy target, or RestoreArgs(restore_type=np.ndarray))"
    )


def _cast(value: Any, dtype: np.dtype, leaf: LeafEntry) -> Any:
    """``value`` as ``dtype``; never silently narrower than asked for."""
    if value.dtype == dtype:
        return value
    out = value.astype(dtype)
    if np.dtype(out.dtype) != dtype:
        raise _narrowed(leaf, dtype)
    return out


def pieces_by_field(pieces) -> dict[str, list]:
    """A leaf's pieces grouped by field (one pass: restores of many leaves stay linear)."""
    out: dict[str, list] = {}
    for p in pieces:
        out.setdefault(p.field, []).append(p)
    return out


def read_region(reader, pieces, codec, field, dtype, region, where) -> np.ndarray:
    """The values of ``field`` in ``region``, from the pieces that overlap it (a
    :class:`FieldRead` of one region, decoded on this thread). Raises FormatError unless
    the pieces cover the region."""
    box = tuple(map(tuple, region))
    return FieldRead(reader, pieces, codec, field, dtype, [box], where).result()[box]


def decode_piece(reader, p, codec, field, dtype, where, data: bytes | None = None) -> np.ndarray:
    """One verified piece, decoded to its box's shape (allocates at most that); ``data``:
    its bytes, already read and verified."""
    if data is None:
        data = reader.read(p, where)
    shape = grid.box_shape(p.box)
    try:
        arr = codec.host_decode(field, data, shape, np.dtype(dtype))
    except LossyError as e:  # same type, with the file, step and leaf
        raise type(e)(f"{where}: piece at {p.file}:{p.offset} ({field!r}): {e}") from e
    except Exception as e:  # a decoder bug or corrupted-but-checksummed data
        raise FormatError(f"{where}: piece at {p.file}:{p.offset} does not decode: {e}") from e
    if arr.shape != shape:
        raise FormatError(f"{where}: piece decoded to shape {arr.shape}, expected {shape}")
    return arr


#: pieces of fewer elements decode on the thread that needs them, not on
#: :func:`piece_pool`: their Python work (reading, checking, the stream's header and tables)
#: outweighs their decoding, and on the pool it contends for the GIL with the restoring
#: thread (a 360-leaf, 10-link 64 MB restore of 46 k-element pieces: 1.10-1.16 s on two
#: threads, 0.83-0.90 s on one)
POOL_MIN_ELEMENTS = 1 << 18

_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def piece_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """A process-wide pool of ``threads`` workers that decode pieces (created once: a restore
    used to start a pool per field, 84 pools and 0.4 s for a 10-link chain of 12 leaves).

    Separate from the entropy coder's own pool, which these tasks wait on.
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = concurrent.futures.ThreadPoolExecutor(
                threads, "orbax_lossy_pieces")
        return pool


def needed_pieces(pieces, regions) -> dict[tuple[str, int], Any]:
    """The pieces overlapping any of ``regions``, by (file, offset)."""
    return {(p.file, p.offset): p for p in pieces
            if any(grid.intersect(p.box, r) is not None for r in regions)}


@functools.lru_cache(maxsize=1024)
def shard_regions(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> frozenset:
    """The boxes this process's shards of a ``shape`` leaf on ``sharding`` cover (cached: a
    restore asks for every leaf of every link)."""
    return frozenset(grid.box_from_index(idx or (), shape)
                     for idx in sharding.addressable_devices_indices_map(shape).values())


#: where a field's host arrays come from: ``take(shape, dtype)`` (see :class:`HostBuffers`)
Take = Callable[[tuple[int, ...], np.dtype], np.ndarray]


class HostBuffers:
    """The host arrays one restore decodes its symbol fields into, lent per chain link and
    recycled once the programs that read them have run.

    A restore decodes every link's fields into new host arrays; a 1 GB all-floats LC chain of
    9 deltas allocated 2.3 GB of them one after another. Fresh memory costs page faults (and,
    on a virtual machine, the host's own faults: a first touch of 1 GB took 0.5-11 s on the
    2-core benchmark machine, a reused gigabyte 0.16 s). Links of one chain have the same
    shapes, so a window's arrays serve the links after it. Only between links of one restore:
    nothing is held once it returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self._lent: dict[int, list[np.ndarray]] = {}

    def lender(self, owner: int) -> Take:
        """``take(shape, dtype)``: an uninitialized aligned array, lent to ``owner``."""
        return functools.partial(self._take, owner)

    def _take(self, owner: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            free = self._free.get(key)
            array = free.pop() if free else aligned_empty(key[0], dtype)
            self._lent.setdefault(owner, []).append(array)
        return array

    def recycle(self, owners: Iterable[int], live: Iterable[Any]) -> None:
        """Make the arrays lent to ``owners`` available again, except any whose memory one of
        the ``live`` arrays uses (a program that returns its input unchanged hands back the
        uploaded array itself, which on CPU is the host array). The caller guarantees that
        every program that took them as input has finished."""
        try:
            used = {shard.data.unsafe_buffer_pointer()
                    for x in live if isinstance(x, jax.Array) for shard in x.addressable_shards}
        except Exception:  # no buffer pointers here: keep every lent array as it is
            return
        with self._lock:
            for owner in owners:
                for array in self._lent.pop(owner, []):
                    if array.ctypes.data not in used:
                        self._free.setdefault((array.shape, array.dtype.str), []).append(array)


class FieldRead:
    """One field's needed pieces, decoded straight into the host arrays of its shards'
    regions: each piece's decoding task also copies it into the regions it overlaps (on the
    decoding thread, not serially while the array is built), and a region that is exactly one
    piece takes the decoded piece itself. Raises FormatError at once unless the pieces cover
    every region."""

    def __init__(self, reader, pieces, codec, field, dtype, regions, where,
                 take: Take | None = None) -> None:
        self.where = where
        self._source = (reader, codec, field, np.dtype(dtype))
        self.arrays: dict[grid.Box, np.ndarray | None] = {}
        self._tasks: list[tuple[Any, list[grid.Box]]] = []
        self._read: dict[tuple[str, int], bytes] = {}  # verified bytes of pending pieces
        self._futures: list[concurrent.futures.Future] = []
        mine = [p for p in pieces if p.field == field]
        if len(regions) == 1 and len(mine) == 1 and tuple(map(tuple, mine[0].box)) == (
                region := tuple(regions)[0]):
            # the common case (one device, one chunk): one piece, exactly the one region
            if take is not None and np.dtype(dtype) == np.uint8:  # symbols decode in place
                self.arrays[region] = take(grid.box_shape(region), np.dtype(dtype))
            else:  # the decoded piece itself
                self.arrays[region] = None
            self._tasks.append((mine[0], [region]))
            return
        needed = needed_pieces(mine, regions)
        for region in regions:
            covered = sum(math.prod(grid.box_shape(inter)) for p in needed.values()
                          if (inter := grid.intersect(p.box, region)) is not None)
            if covered != math.prod(grid.box_shape(region)):
                raise FormatError(f"{where}: field {field!r} region {region} is not fully "
                                  "stored")
            whole = [p for p in needed.values() if tuple(map(tuple, p.box)) == region]
            if take is not None and np.dtype(dtype) == np.uint8:  # symbols decode in place
                self.arrays[region] = take(grid.box_shape(region), np.dtype(dtype))
            else:
                self.arrays[region] = None if whole else aligned_empty(grid.box_shape(region),
                                                                       dtype)
        for p in needed.values():
            self._tasks.append((p, [r for r in regions if grid.intersect(p.box, r) is not None]))

    def start(self, threads: int, ahead: bool = False) -> FieldRead:
        """Submit the pieces of at least :data:`POOL_MIN_ELEMENTS` to :func:`piece_pool`
        (with several threads, and several pieces or ``ahead``: the result is needed only
        later, so even one piece decodes meanwhile); the rest are decoded in :meth:`result`,
        a lone piece's blocks on every thread."""
        if self._tasks and threads > 1 and (ahead or len(self._tasks) > 1):
            pooled: list[tuple[Any, list[grid.Box]]] = []
            here: list[tuple[Any, list[grid.Box]]] = []
            for task in self._tasks:
                large = math.prod(grid.box_shape(task[0].box)) >= POOL_MIN_ELEMENTS
                (pooled if large else here).append(task)
            if pooled:
                pool = piece_pool(threads)
                self._futures = [pool.submit(self._place, *task, serial=True)
                                 for task in pooled]
                self._tasks = here
        return self

    def _place(self, p, regions: list[grid.Box], serial: bool = False) -> None:
        reader, codec, field, dtype = self._source
        box = tuple(map(tuple, p.box))
        destination = self._destination(box, regions)
        # on a pool thread (one piece per thread) the piece's blocks stay on that thread
        with (blocks_on_this_thread() if serial else contextlib.nullcontext(),
              decode_into(destination)):
            data = decode_piece(reader, p, codec, field, dtype, self.where,
                                self._read.pop((p.file, p.offset), None))
        self._put(box, regions, destination, data)

    def _put(self, box: grid.Box, regions: list[grid.Box], destination: np.ndarray | None,
             data: np.ndarray) -> None:
        """Put a decoded piece into the regions it overlaps (nothing to do where it was
        decoded in place, into ``destination``)."""
        dtype = self._source[3]
        if (destination is not None and data.ctypes.data == destination.ctypes.data
                and data.shape == destination.shape and data.dtype == destination.dtype):
            return  # decoded in place
        for region in regions:
            out = self.arrays[region]
            if out is None:  # the region is exactly this piece
                self.arrays[region] = data if data.dtype == dtype else data.astype(dtype)
                continue
            inter = grid.intersect(box, region)
            assert inter is not None  # regions were chosen by overlap
            out[grid.local_slices(inter, region)] = data[grid.local_slices(inter, box)]

    def _destination(self, box: grid.Box, regions: list[grid.Box]) -> np.ndarray | None:
        """Where a uint8 piece inside one region's array can be decoded in place: that
        array's slab of the piece's box, when it is contiguous (boxes that cut only the
        first axis of the region); else None (decoded, then copied)."""
        if self._source[3] != np.uint8 or len(regions) != 1:
            return None
        region = regions[0]
        out = self.arrays[region]
        if out is None or grid.intersect(box, region) != box:
            return None
        index: tuple[Any, ...] = (*grid.local_slices(box, region), Ellipsis)
        slab = out[index]  # (the Ellipsis: a view even of a 0-d array, not a scalar)
        return slab if slab.flags.c_contiguous and slab.size else None

    def small_symbol_tasks(self) -> list[tuple[Any, list[grid.Box]]]:
        """The pending pieces of a symbol field below :data:`POOL_MIN_ELEMENTS` that
        :func:`decode_together` has not tried yet (those it declined keep their bytes in
        ``_read`` and decode in :meth:`result`)."""
        codec, field, dtype = self._source[1:]
        if dtype != np.uint8 or not self._tasks:
            return []
        spec = codec.fields().get(field)
        if spec is None or spec.coder != "symbols":
            return []
        return [task for task in self._tasks
                if math.prod(grid.box_shape(task[0].box)) < POOL_MIN_ELEMENTS
                and (task[0].file, task[0].offset) not in self._read]

    def cancel(self) -> None:
        """Drop the pieces that have not started decoding (a restore that failed elsewhere)."""
        for future in self._futures:
            future.cancel()
        self._tasks = []

    def result(self) -> dict[grid.Box, np.ndarray]:
        """The host array of every region (waits for the pieces; the first failure raises)."""
        for task in self._tasks:
            self._place(*task)
        self._tasks = []
        for future in self._futures:
            future.result()
        return self.arrays  # type: ignore[return-value]


def decode_together(reads: Iterable[FieldRead]) -> None:
    """Decode the small symbol pieces that ``reads`` left for their :meth:`FieldRead.result`
    in one kernel call (:func:`stream.decode_symbols_many`: headers read in the kernel,
    four streams at a time), on this thread. A piece that call does not decode stays
    pending, its verified bytes kept, for ``result`` to decode and report as before. A
    restore of many small leaves decodes a leaf's links together this way (ten 47 k-symbol
    LC pieces, as a 360-leaf 64 MB state has: 23 us a piece against 58 us one by one)."""
    pending = [(read, task) for read in reads for task in read.small_symbol_tasks()]
    if len(pending) < 2:
        return
    streams, boxes, alphabets, outputs = [], [], [], []
    for read, (p, regions) in pending:
        reader, codec, field, _ = read._source
        box = tuple(map(tuple, p.box))
        streams.append(reader.read(p, read.where))
        boxes.append(box)
        alphabets.append(codec.fields()[field].alphabet)
        outputs.append(read._destination(box, regions))
    counts = [math.prod(grid.box_shape(box)) for box in boxes]
    decoded = decode_symbols_many(streams, counts, alphabets, outputs)
    for (read, task), data, stream, box, destination in zip(
            pending, decoded, streams, boxes, outputs, strict=True):
        p, regions = task
        if data is None:  # decoded (and reported) the usual way
            read._read[(p.file, p.offset)] = stream
            continue
        read._tasks.remove(task)
        read._put(box, regions, destination, data.reshape(grid.box_shape(box)))


def start_field(reader, pieces, codec, field, dtype, shape, sharding, where,
                threads, ahead: bool = False, take: Take | None = None) -> FieldRead:
    """Start decoding the pieces of ``field`` that this process's shards on ``sharding``
    overlap (see :class:`FieldRead`; ``ahead``: its result is needed only later; ``take``:
    where uint8 fields get their host arrays, e.g. :meth:`HostBuffers.lender`)."""
    return FieldRead(reader, pieces, codec, field, dtype, shard_regions(tuple(shape), sharding),
                     where, take).start(threads, ahead)


def assemble_field(
    reader, pieces, codec, field, dtype, shape, sharding, where, threads,
    started: FieldRead | None = None, take: Take | None = None, host: bool = False,
) -> jax.Array | np.ndarray:
    """Build one field as a jax.Array on ``sharding`` from the pieces its shards overlap;
    ``started``: their decoding, already submitted by :func:`start_field`. ``host``: a
    field that is one region on one CPU device comes back as its host array, for a program
    to take as it is (see :func:`transfer.passes_as_host`)."""
    if started is None:
        started = start_field(reader, pieces, codec, field, dtype, shape, sharding, where,
                              threads, take=take)
    arrays = started.result()
    if host and len(arrays) == 1:
        (array,) = arrays.values()
        if array.shape == tuple(shape) and array.dtype == np.dtype(dtype):
            return array

    def callback(index: tuple[slice, ...] | None) -> np.ndarray:
        return arrays[grid.box_from_index(index or (), shape)]

    return transfer.upload(shape, dtype, sharding, callback)


def read_regions(
    reader, pieces, codec, field, dtype, shape, regions, where, threads
) -> np.ndarray:
    """A host array of ``shape`` holding ``field`` in ``regions`` (zeros elsewhere), read from
    the pieces that overlap them only (each piece read and decoded once, on ``threads``)."""
    out = np.zeros(tuple(shape), dtype)
    arrays = FieldRead(reader, pieces, codec, field, dtype, regions, where).start(threads).result()
    for region, data in arrays.items():
        out[tuple(slice(a, b) for a, b in region)] = data
    return out
