"""Checksummed msgpack envelopes: the container of every structure file (manifest, index).

``{"magic": "orbax-lossy", "kind": <file type>, "version": <int>, "crc32": <int>,
"encoding": "zlib", "body": <bytes>}``; ``body`` is msgpack, zlib-compressed since format
version 2, and ``crc32`` covers the stored body. See ``docs/format.md``.

The file primitives here serve every format file. Local paths use OS calls (``os.open`` with
``O_NONBLOCK`` and an ``fstat`` check, ``os.pread``); URIs (``gs://``, ``s3://``) go through
``etils.epath``, with ranged reads of payload pieces where epath's backend is fsspec
(``docs/object_stores.md``).
"""

from __future__ import annotations

import os
import stat
import zlib
from typing import Any

import msgpack
import numpy as np

try:  # ISA-L's CRC-32 (the same polynomial and values as zlib's), 7x faster with PCLMUL
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without isal wheels: zlib's
    _crc32 = zlib.crc32

from orbax_lossy.errors import ChecksumError, FormatError, UnsupportedVersionError
from orbax_lossy.format.steps import as_epath, is_remote

FORMAT_VERSION = 4
ENVELOPE_ENCODINGS = ("msgpack", "zlib")
MAGIC = "orbax-lossy"
# A structure file larger than this is not one we wrote; refuse before allocating.
MAX_ENVELOPE_BYTES = 1 << 30
# A manifest body inflates 5-7x (at most ~20x for trees of thousands of identical leaves): a
# body inflating past INFLATE_FLOOR + INFLATE_RATIO x its stored size is a decompression bomb.
INFLATE_FLOOR = 8 << 20
INFLATE_RATIO = 32
# msgpack containers (maps and arrays) per inflated byte: a writer's manifest has one per
# 15+ bytes; a body of empty containers (1 byte each, 56+ bytes of memory) is refused early.
CONTAINER_BYTES = 4


def crc32(data: bytes | memoryview | np.ndarray) -> int:
    """CRC-32 of a buffer, zlib's checksum (computed by ISA-L where installed: 14 GB/s
    against zlib's 2 GB/s on the benchmark machine; both release the GIL)."""
    buffer: Any = data  # (numpy's, isal's and Python's stubs disagree by version on buffers)
    return int(_crc32(memoryview(buffer).cast("B"))) & 0xFFFFFFFF


def pack_envelope(file_type: str, body: Any) -> bytes:
    """Serialize ``body`` into a version-``FORMAT_VERSION`` envelope."""
    body_bytes = zlib.compress(msgpack.packb(body, use_bin_type=True), 6)
    return msgpack.packb(
        {
            "magic": MAGIC,
            "kind": file_type,
            "version": FORMAT_VERSION,
            "crc32": crc32(body_bytes),
            "encoding": "zlib",
            "body": body_bytes,
        },
        use_bin_type=True,
    )


def inflate_limit(stored: int) -> int:
    """The most bytes a stored (compressed) body of ``stored`` bytes may inflate to."""
    return min(MAX_ENVELOPE_BYTES, INFLATE_FLOOR + INFLATE_RATIO * stored)


def _inflate(body: bytes, where: str) -> bytes:
    """zlib-decompress ``body``, refusing output past :func:`inflate_limit`."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(body, inflate_limit(len(body)))
    except zlib.error as e:
        raise FormatError(f"{where}: compressed body does not inflate ({e})") from e
    if inflater.unconsumed_tail or not inflater.eof:
        raise FormatError(f"{where}: compressed body is truncated or inflates past "
                          f"{inflate_limit(len(body))} bytes (more than any manifest we write)")
    return out


def _unpack_bounded(data: bytes, where: str) -> Any:
    """msgpack-decode ``data``, refusing more containers than a writer produces for its size."""
    budget = [64 + len(data) // CONTAINER_BYTES]

    def count(obj: Any) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise FormatError(f"{where}: more msgpack maps and arrays than any manifest of "
                              f"{len(data)} bytes holds")
        return obj

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, list_hook=count,
                               object_hook=count)
    except FormatError:
        raise
    except Exception as e:  # msgpack raises several unrelated types
        raise FormatError(f"{where}: body does not decode ({e})") from e


def unpack_envelope(data: bytes, file_type: str, where: str) -> Any:
    """Validate and decode an envelope; ``where`` names the file in error messages."""
    return _unpack_bounded(unpack_envelope_bytes(data, file_type, where), where)


def unpack_envelope_bytes(data: bytes, file_type: str, where: str) -> bytes:
    """Validate an envelope and return its body as msgpack bytes (inflated, not decoded)."""
    try:
        outer = msgpack.unpackb(data, raw=False, strict_map_key=False, max_map_len=16,
                                max_array_len=0, max_str_len=64, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise FormatError(f"{where}: not a valid msgpack envelope ({e})") from e
    if not isinstance(outer, dict) or outer.get("magic") != MAGIC:
        raise FormatError(f"{where}: missing orbax-lossy magic; not an orbax-lossy file")
    if outer.get("kind") != file_type:
        raise FormatError(f"{where}: expected a {file_type!r} file, found {outer.get('kind')!r}")
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
    return body


def write_envelope(path: os.PathLike | str, file_type: str, body: Any) -> None:
    """Write ``body`` as an envelope file."""
    write_bytes(path, pack_envelope(file_type, body))


def write_bytes(path: os.PathLike | str, data: bytes) -> None:
    """Write a whole file (an object, on an object store: one upload)."""
    path = os.fspath(path)
    if is_remote(path):
        as_epath(path).write_bytes(data)
        return
    with open(path, "wb") as f:
        f.write(data)


def open_for_writing(path: os.PathLike | str) -> Any:
    """A binary file object writing ``path`` (on an object store, uploaded as it is closed)."""
    path = os.fspath(path)
    if is_remote(path):
        return as_epath(path).open("wb")
    return open(path, "wb")  # noqa: SIM115 - the caller closes it


# --------------------------------------------------------------------------- remote files


def _remote_error(path: str, what: str, e: OSError) -> FormatError:
    if isinstance(e, FileNotFoundError):
        return FormatError(f"{path}: {what} is missing")
    if isinstance(e, IsADirectoryError):
        return FormatError(f"{path}: {what} is not a regular file")
    return FormatError(f"{path}: {what} cannot be read ({e})")


def _remote_size(path: str, what: str) -> int:
    """Size of object ``path``; a "directory" (a prefix) is not a file."""
    try:
        st = as_epath(path).stat()
    except OSError as e:
        raise _remote_error(path, what, e) from e
    if st.is_directory or st.length is None:
        raise FormatError(f"{path}: {what} is not a regular file")
    return int(st.length)


def _remote_read(path: str, offset: int, length: int, what: str) -> bytes:
    """``length`` bytes of object ``path`` at ``offset`` (fewer only at its end).

    Where epath serves the path with fsspec, one ranged request (``cat_file``) reads exactly
    the range: an fsspec file object would read ahead a whole block (50 MB on s3fs) per piece.
    Other backends (``tf.io.gfile`` when TensorFlow is installed) seek and read.
    """
    p = as_epath(path)
    try:
        from etils.epath import backend

        # epath's own backend object for this path (private attribute: absent -> no match)
        if getattr(p, "_backend", None) is getattr(backend, "fsspec_backend", False):
            fs = backend.fsspec_backend.fs(path)
            return bytes(fs.cat_file(path, start=offset, end=offset + length))
        with p.open("rb") as f:
            f.seek(offset)
            return bytes(f.read(length))
    except OSError as e:
        raise _remote_error(path, what, e) from e


def open_regular(path: str, what: str) -> tuple[int, int]:
    """``(fd, size)`` of ``path`` opened read-only; it must be a regular file.

    The file is opened non-blocking and checked with ``fstat`` on the open descriptor, so a
    FIFO or device put in its place (even between a check and the open) never blocks a read.
    """
    if "\x00" in path:
        raise FormatError(f"{path!r}: {what} name holds a NUL byte")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as e:
        raise FormatError(f"{path}: {what} is missing") from e
    except OSError as e:
        raise FormatError(f"{path}: {what} cannot be read ({e})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: {what} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_at(fd: int, offset: int, length: int, path: str) -> bytes:
    """``length`` bytes at ``offset`` (fewer only at the end of the file)."""
    chunks, done = [], 0
    try:
        while done < length:
            part = os.pread(fd, min(length - done, 1 << 30), offset + done)
            if not part:
                break
            chunks.append(part)
            done += len(part)
    except OSError as e:
        raise FormatError(f"{path}: read failed ({e})") from e
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def regular_file_size(path: str, what: str) -> int:
    """Size of ``path``, which must be a regular file (not a FIFO, device or directory)."""
    if is_remote(path):
        return _remote_size(path, what)
    fd, size = open_regular(path, what)
    os.close(fd)
    return size


def read_range(path: str, offset: int, length: int, what: str) -> bytes:
    """``length`` bytes of regular file ``path`` at ``offset`` (fewer only at its end).

    A local file is opened as :func:`open_regular` does (no FIFO or device is ever read).
    """
    if is_remote(path):
        return _remote_read(path, offset, length, what)
    fd, _ = open_regular(path, what)
    try:
        return read_at(fd, offset, length, path)
    finally:
        os.close(fd)


def read_envelope(path: os.PathLike | str, file_type: str) -> Any:
    """Read and validate an envelope file (a regular file of at most 1 GiB)."""
    path = os.fspath(path)
    return _unpack_bounded(read_envelope_bytes(path, file_type), path)


def read_envelope_bytes(path: os.PathLike | str, file_type: str) -> bytes:
    """Read and validate an envelope file; its body as msgpack bytes (inflated, not decoded)."""
    path = os.fspath(path)
    if is_remote(path):
        size = _remote_size(path, "file")
        if size > MAX_ENVELOPE_BYTES:
            raise FormatError(f"{path}: {size} bytes is larger than any manifest we write")
        return unpack_envelope_bytes(_remote_read(path, 0, size, "file"), file_type, path)
    fd, size = open_regular(path, "file")
    try:
        if size > MAX_ENVELOPE_BYTES:
            raise FormatError(f"{path}: {size} bytes is larger than any manifest we write")
        data = read_at(fd, 0, size, path)
    finally:
        os.close(fd)
    return unpack_envelope_bytes(data, file_type, path)


def unpack_body(data: bytes, where: str) -> Any:
    """msgpack-decode an inflated body (:func:`read_envelope_bytes`) with the container bound."""
    return _unpack_bounded(data, where)
