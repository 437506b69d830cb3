"""On-disk container: chunk grid, checksummed payload files and the msgpack manifest.

An item directory written by :class:`orbax_lossy.LossyCheckpointHandler` holds::

    manifest.msgpack      the merged manifest (written by the primary host in ``finalize``)
    data.p<K>.bin         payload bytes written by process K (pieces concatenated)

While a save is in flight every process also writes ``index.p<K>.msgpack`` (its part of the
manifest); the primary host merges them into ``manifest.msgpack`` and removes them before the
commit. Every file that holds structure (manifest, indexes) is a msgpack *envelope*::

    {"magic": "orbax-lossy", "kind": <str>, "version": <int>, "crc32": <int>,
     "encoding": "zlib", "body": <bytes>}

where ``body`` is msgpack, zlib-compressed since version 2 (``encoding``; a manifest repeats
the same keys for every leaf, and compression makes it 5-7x smaller, which matters when a
delta checkpoint's payload is only tens of kB), and ``crc32`` covers the stored ``body``.
Every payload piece carries its own crc32 in the manifest and is verified on every read.
See ``docs/format.md``.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from orbax_lossy.errors import (
    ChecksumError,
    FormatError,
    TruncatedError,
    UnsupportedVersionError,
)

FORMAT_VERSION = 2
ENVELOPE_ENCODINGS = ("msgpack", "zlib")
MAGIC = "orbax-lossy"
MANIFEST_NAME = "manifest.msgpack"
DEFAULT_CHUNK_BYTES = 4 << 20
# A manifest larger than this is not one we wrote; refuse before allocating.
MAX_ENVELOPE_BYTES = 1 << 30

Box = tuple[tuple[int, int], ...]


def data_file_name(process_index: int) -> str:
    return f"data.p{process_index}.bin"


def index_file_name(process_index: int) -> str:
    return f"index.p{process_index}.msgpack"


def crc32(data: bytes | memoryview | np.ndarray) -> int:
    """CRC-32 of a buffer (zlib's, which releases the GIL on large inputs)."""
    return zlib.crc32(memoryview(data).cast("B")) & 0xFFFFFFFF


# --------------------------------------------------------------------------- chunk grid


def chunk_shape_for(shape: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """Chunk shape of the fixed grid of a global array.

    Depends only on the global shape, the item size and the target chunk size, never on the
    sharding the array had when it was saved. The largest dimension is halved (rounding up)
    until a chunk holds at most ``target_bytes``; ties go to the leading dimension. Chunks are
    therefore close to cubes, so a restore that slices any axis reads roughly the fraction of
    the payload it needs.
    """
    if target_bytes <= 0:
        raise ValueError(f"target chunk bytes must be positive, got {target_bytes}")
    chunk = [max(int(d), 1) for d in shape]
    limit = max(target_bytes // max(itemsize, 1), 1)
    while math.prod(chunk) > limit:
        axis = max(range(len(chunk)), key=lambda a: (chunk[a], -a))
        if chunk[axis] == 1:
            break
        chunk[axis] = -(-chunk[axis] // 2)
    return tuple(chunk)


def grid_pieces(box: Box, chunk: Sequence[int]) -> Iterator[Box]:
    """Intersections of ``box`` (a shard's region) with the cells of the chunk grid."""
    if not box:
        yield ()
        return
    ranges = []
    for (start, stop), c in zip(box, chunk, strict=True):
        if stop <= start:
            return
        cells = []
        first = (start // c) * c
        for cell_start in range(first, stop, c):
            cells.append((max(start, cell_start), min(stop, cell_start + c)))
        ranges.append(cells)
    yield from _product(ranges)


def _product(ranges: list[list[tuple[int, int]]]) -> Iterator[Box]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head, *tail)


def box_from_index(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    """Turn a shard index (tuple of slices, as in ``jax.Shard.index``) into a box."""
    out = []
    for sl, dim in zip(index, shape, strict=False):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise FormatError(f"strided shard index {index} is not supported")
        out.append((start, stop))
    for dim in shape[len(out) :]:
        out.append((0, dim))
    return tuple(out)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def local_slices(box: Box, within: Box) -> tuple[slice, ...]:
    """Slices that select ``box`` inside an array that holds region ``within``."""
    return tuple(slice(s - w, e - w) for (s, e), (w, _) in zip(box, within, strict=True))


# --------------------------------------------------------------------------- envelopes


def pack_envelope(kind: str, body: Any) -> bytes:
    body_bytes = zlib.compress(msgpack.packb(body, use_bin_type=True), 6)
    return msgpack.packb(
        {
            "magic": MAGIC,
            "kind": kind,
            "version": FORMAT_VERSION,
            "crc32": crc32(body_bytes),
            "encoding": "zlib",
            "body": body_bytes,
        },
        use_bin_type=True,
    )


def _inflate(body: bytes, where: str) -> bytes:
    """zlib-decompress ``body``, refusing output past ``MAX_ENVELOPE_BYTES``."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(body, MAX_ENVELOPE_BYTES)
    except zlib.error as e:
        raise FormatError(f"{where}: compressed body does not inflate ({e})") from e
    if inflater.unconsumed_tail or not inflater.eof:
        raise FormatError(f"{where}: compressed body is truncated or larger than any we write")
    return out


def unpack_envelope(data: bytes, kind: str, where: str) -> Any:
    """Validate and decode an envelope; ``where`` names the file in error messages."""
    try:
        outer = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise FormatError(f"{where}: not a valid msgpack envelope ({e})") from e
    if not isinstance(outer, dict) or outer.get("magic") != MAGIC:
        raise FormatError(f"{where}: missing orbax-lossy magic; not an orbax-lossy file")
    if outer.get("kind") != kind:
        raise FormatError(f"{where}: expected a {kind!r} file, found {outer.get('kind')!r}")
    version = outer.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise UnsupportedVersionError(
            f"{where}: format version {version!r}; this library reads versions 1..{FORMAT_VERSION}"
        )
    body = outer.get("body")
    if not isinstance(body, bytes) or not isinstance(outer.get("crc32"), int):
        raise FormatError(f"{where}: envelope has no body or checksum")
    if crc32(body) != outer["crc32"]:
        raise ChecksumError(f"{where}: checksum mismatch, the file is corrupted")
    encoding = outer.get("encoding", "msgpack")
    if encoding not in ENVELOPE_ENCODINGS:
        raise UnsupportedVersionError(f"{where}: unknown envelope encoding {encoding!r}")
    if encoding == "zlib":
        body = _inflate(body, where)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:
        raise FormatError(f"{where}: body does not decode ({e})") from e


def write_envelope(path: os.PathLike | str, kind: str, body: Any) -> None:
    with open(path, "wb") as f:
        f.write(pack_envelope(kind, body))


def read_envelope(path: os.PathLike | str, kind: str) -> Any:
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError as e:
        raise FormatError(f"{path}: file is missing") from e
    if size > MAX_ENVELOPE_BYTES:
        raise FormatError(f"{path}: {size} bytes is larger than any manifest we write")
    with open(path, "rb") as f:
        data = f.read()
    return unpack_envelope(data, kind, path)


# --------------------------------------------------------------------------- payload pieces


@dataclass(frozen=True)
class PieceRef:
    """Where one encoded piece of one field of one leaf lives."""

    field: str
    box: Box
    file: str
    offset: int
    length: int
    crc32: int

    def to_msgpack(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "box": [list(b) for b in self.box],
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "crc32": self.crc32,
        }

    @classmethod
    def from_msgpack(cls, d: dict[str, Any], where: str) -> PieceRef:
        try:
            box = tuple((int(a), int(b)) for a, b in d["box"])
            ref = cls(
                field=str(d["field"]),
                box=box,
                file=str(d["file"]),
                offset=int(d["offset"]),
                length=int(d["length"]),
                crc32=int(d["crc32"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{where}: malformed piece entry {d!r}") from e
        if ref.offset < 0 or ref.length < 0 or any(b < a or a < 0 for a, b in box):
            raise FormatError(f"{where}: impossible piece entry {d!r}")
        if os.sep in ref.file or ref.file.startswith(".") or not ref.file.startswith("data.p"):
            raise FormatError(f"{where}: piece file name {ref.file!r} is not allowed")
        return ref


class PayloadWriter:
    """Appends pieces to one process's data file and records their location and crc32."""

    def __init__(self, path: os.PathLike | str) -> None:
        self._path = os.fspath(path)
        self._name = os.path.basename(self._path)
        self._file = open(self._path, "wb")  # noqa: SIM115 - closed in close()
        self._offset = 0

    def append(self, field: str, box: Box, payload: bytes) -> PieceRef:
        self._file.write(payload)
        ref = PieceRef(field, box, self._name, self._offset, len(payload), crc32(payload))
        self._offset += len(payload)
        return ref

    @property
    def bytes_written(self) -> int:
        return self._offset

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


class PayloadReader:
    """Reads pieces back, verifying size and checksum; counts the bytes it read."""

    def __init__(self, directory: os.PathLike | str) -> None:
        self._dir = os.fspath(directory)
        self.bytes_read = 0

    def read(self, ref: PieceRef, where: str) -> bytes:
        path = os.path.join(self._dir, ref.file)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError as e:
            raise FormatError(f"{where}: payload file {path} is missing") from e
        if ref.offset + ref.length > size:
            raise TruncatedError(
                f"{where}: {path} has {size} bytes but a piece ends at {ref.offset + ref.length}"
            )
        with open(path, "rb") as f:
            f.seek(ref.offset)
            data = f.read(ref.length)
        self.bytes_read += len(data)
        if len(data) != ref.length:
            raise TruncatedError(f"{where}: short read from {path}")
        if crc32(data) != ref.crc32:
            raise ChecksumError(
                f"{where}: checksum mismatch in {path} at offset {ref.offset} "
                f"({ref.length} bytes): the checkpoint is corrupted"
            )
        return data


def check_coverage(leaf: dict[str, Any], directory: str) -> None:
    """The pieces of every field of a merged leaf cover its array exactly once (by volume)."""
    shape = leaf["shape"]
    total = math.prod(shape)
    fields: dict[str, int] = {}
    for p in leaf["pieces"]:
        fields[p["field"]] = fields.get(p["field"], 0) + math.prod(b - a for a, b in p["box"])
    for name, covered in fields.items():
        if covered != total:
            raise FormatError(
                f"{directory}: leaf {leaf['path']} field {name!r} covers {covered} of "
                f"{total} elements (a process did not write its shards)"
            )
