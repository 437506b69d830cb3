"""Checksummed msgpack envelopes: the container of every structure file (manifest, index).

``{"magic": "orbax-lossy", "kind": <file type>, "version": <int>, "crc32": <int>,
"encoding": "zlib", "body": <bytes>}``; ``body`` is msgpack, zlib-compressed since format
version 2, and ``crc32`` covers the stored body. See ``docs/format.md``.
"""

from __future__ import annotations

import os
import stat
import zlib
from typing import Any

import msgpack
import numpy as np

from orbax_lossy.errors import ChecksumError, FormatError, UnsupportedVersionError

FORMAT_VERSION = 2
ENVELOPE_ENCODINGS = ("msgpack", "zlib")
MAGIC = "orbax-lossy"
# A structure file larger than this is not one we wrote; refuse before allocating.
MAX_ENVELOPE_BYTES = 1 << 30


def crc32(data: bytes | memoryview | np.ndarray) -> int:
    """CRC-32 of a buffer (zlib's, which releases the GIL on large inputs)."""
    return zlib.crc32(memoryview(data).cast("B")) & 0xFFFFFFFF


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


def unpack_envelope(data: bytes, file_type: str, where: str) -> Any:
    """Validate and decode an envelope; ``where`` names the file in error messages."""
    try:
        outer = msgpack.unpackb(data, raw=False, strict_map_key=False)
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
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:
        raise FormatError(f"{where}: body does not decode ({e})") from e


def write_envelope(path: os.PathLike | str, file_type: str, body: Any) -> None:
    """Write ``body`` as an envelope file."""
    with open(path, "wb") as f:
        f.write(pack_envelope(file_type, body))


def regular_file_size(path: str, what: str) -> int:
    """Size of ``path``, which must be a regular file (not a FIFO, device or directory)."""
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise FormatError(f"{path}: {what} is missing") from e
    except OSError as e:
        raise FormatError(f"{path}: {what} cannot be read ({e})") from e
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path}: {what} is not a regular file")
    return st.st_size


def read_envelope(path: os.PathLike | str, file_type: str) -> Any:
    """Read and validate an envelope file."""
    path = os.fspath(path)
    size = regular_file_size(path, "file")
    if size > MAX_ENVELOPE_BYTES:
        raise FormatError(f"{path}: {size} bytes is larger than any manifest we write")
    with open(path, "rb") as f:
        data = f.read(MAX_ENVELOPE_BYTES + 1)
    return unpack_envelope(data, file_type, path)
