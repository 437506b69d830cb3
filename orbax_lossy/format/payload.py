"""Payload files: each process appends encoded pieces to ``data.p<K>.bin``.

A :class:`PieceRef` records where one piece (one chunk-grid cell of one field of one leaf)
lives and its crc32; every read verifies size and checksum. Local files are written, fsynced
and read with OS calls; URIs (``gs://``, ``s3://``) through ``etils.epath`` (see
``docs/object_stores.md``).
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from orbax_lossy.errors import ChecksumError, FormatError, TruncatedError
from orbax_lossy.format.envelope import (
    crc32,
    open_for_writing,
    open_regular,
    read_at,
    read_range,
    regular_file_size,
)
from orbax_lossy.format.grid import Box
from orbax_lossy.format.steps import abspath, inside, is_remote

_DATA_FILE = re.compile(r"data\.p\d{1,6}\.bin")


def data_file_name(process_index: int) -> str:
    """Payload file of one process."""
    return f"data.p{process_index}.bin"


def index_file_name(process_index: int) -> str:
    """Per-process index file (merged into the manifest by ``finalize``)."""
    return f"index.p{process_index}.msgpack"


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


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
        """The manifest entry of this piece."""
        return {
            "field": self.field,
            "box": [list(b) for b in self.box],
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "crc32": self.crc32,
        }

    @classmethod
    def from_msgpack(cls, d: Any, where: str) -> PieceRef:
        """Parse and validate a manifest piece entry."""
        try:
            if not isinstance(d, dict) or not isinstance(d["field"], str):
                raise TypeError("not a piece entry")
            if not isinstance(d["file"], str):
                raise TypeError("file is not a string")
            box = tuple((_int(a), _int(b)) for a, b in d["box"])
            ref = cls(
                field=d["field"],
                box=box,
                file=d["file"],
                offset=_int(d["offset"]),
                length=_int(d["length"]),
                crc32=_int(d["crc32"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{where}: malformed piece entry {str(d)[:200]}") from e
        if ref.offset < 0 or ref.length < 0 or any(b < a or a < 0 for a, b in box):
            raise FormatError(f"{where}: impossible piece entry {str(d)[:200]}")
        if not _DATA_FILE.fullmatch(ref.file):
            raise FormatError(f"{where}: piece file name {ref.file!r} is not allowed")
        return ref

    def moved(self, d: dict[str, Any], where: str) -> PieceRef:
        """This piece at the place ``d`` gives (any of ``offset``, ``length``, ``crc32``; a
        delta's piece stored as its difference from its base's), checked as
        :meth:`from_msgpack` checks them."""
        try:
            ref = PieceRef(self.field, self.box, self.file, _int(d.get("offset", self.offset)),
                           _int(d.get("length", self.length)), _int(d.get("crc32", self.crc32)))
        except TypeError as e:
            raise FormatError(f"{where}: malformed piece entry {str(d)[:200]}") from e
        if ref.offset < 0 or ref.length < 0:
            raise FormatError(f"{where}: impossible piece entry {str(d)[:200]}")
        return ref


class PayloadWriter:
    """Appends pieces to one process's data file and records their location and crc32."""

    def __init__(self, path: os.PathLike | str) -> None:
        self._path = os.fspath(path)
        self._name = os.path.basename(self._path)
        self._remote = is_remote(self._path)
        self._file = open_for_writing(self._path)  # closed in close()
        self._offset = 0

    def append(self, field: str, box: Box, payload: bytes) -> PieceRef:
        """Write one piece; returns its reference."""
        self._file.write(payload)
        ref = PieceRef(field, box, self._name, self._offset, len(payload), crc32(payload))
        self._offset += len(payload)
        return ref

    @property
    def bytes_written(self) -> int:
        """Bytes appended so far."""
        return self._offset

    def close(self) -> None:
        """Flush, fsync and close the file (an object store's upload completes on close)."""
        if not self._remote:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()


class PayloadReader:
    """Reads pieces back, verifying size and checksum; counts the bytes it read.

    Only regular files named ``data.p<K>.bin`` of the directory are opened; with ``root``,
    a payload file whose real path (symlinks resolved) leaves ``root`` is refused. On an
    object store (no symlinks) the check is lexical.
    """

    def __init__(self, directory: os.PathLike | str, root: os.PathLike | str | None = None) -> None:
        self._dir = os.fspath(directory)
        self._remote = is_remote(self._dir)
        if root is None:
            self._root = None
        else:
            self._root = abspath(root) if self._remote else os.path.realpath(os.fspath(root))
        self._sizes: dict[str, int] = {}
        # one descriptor per local payload file, opened (and checked) on its first piece:
        # a restore reads thousands of pieces from a few files, on many threads (os.pread
        # on a shared descriptor); closed by close() (or when the reader is collected)
        self._fds: dict[str, int] = {}
        self._paths: dict[str, str] = {}  # file names checked, and their paths
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _path(self, name: str, where: str) -> str:
        path = self._paths.get(name)
        if path is not None:  # checked before
            return path
        if not _DATA_FILE.fullmatch(name):
            raise FormatError(f"{where}: piece file name {name!r} is not allowed")
        path = os.path.join(self._dir, name)
        if self._root is not None and name not in self._sizes:
            real = abspath(path) if self._remote else os.path.realpath(path)
            if not inside(real, self._root):
                how = "" if self._remote else " (symlink)"
                raise FormatError(f"{where}: payload file {path} leads outside the checkpoint "
                                  f"root {self._root}{how}")
        if self._root is None or name in self._sizes:
            self._paths[name] = path
        return path

    def file_size(self, name: str, where: str) -> int:
        """Size of one payload file of this directory (a regular file), cached."""
        size = self._sizes.get(name)
        if size is None:
            if self._remote:
                size = regular_file_size(self._path(name, where), f"{where}: payload file")
                self._sizes[name] = size
            else:
                size = self._open(name, where)[1]
        return size

    def _open(self, name: str, where: str) -> tuple[int, int]:
        """``(fd, size)`` of a local payload file, opened once per reader."""
        fd = self._fds.get(name)
        if fd is not None:
            size = self._sizes.get(name)
            if size is not None:
                return fd, size
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd, size = open_regular(self._path(name, where), f"{where}: payload file")
                self._fds[name], self._sizes[name] = fd, size
            return fd, self._sizes[name]

    def close(self) -> None:
        """Close the payload files this reader opened (it may be used again: they reopen)."""
        with self._lock:
            fds, self._fds = self._fds, {}
            self._sizes.clear()
            self._paths.clear()
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        try:  # noqa: SIM105 (no module globals here: at interpreter exit they may be gone)
            self.close()
        except Exception:
            pass

    def read(self, ref: PieceRef, where: str) -> bytes:
        """The verified bytes of one piece (its range is checked against the file first)."""
        path = self._path(ref.file, where)
        if self._remote:
            size = self.file_size(ref.file, where)
        else:
            fd, size = self._open(ref.file, where)
        if ref.offset + ref.length > size:
            raise TruncatedError(
                f"{where}: {path} has {size} bytes but a piece ends at {ref.offset + ref.length}"
            )
        if self._remote:
            data = read_range(path, ref.offset, ref.length, f"{where}: payload file")
        else:
            data = read_at(fd, ref.offset, ref.length, path)
        self.bytes_read += len(data)
        if len(data) != ref.length:
            raise TruncatedError(f"{where}: short read from {path}")
        if crc32(data) != ref.crc32:
            raise ChecksumError(
                f"{where}: checksum mismatch in {path} at offset {ref.offset} "
                f"({ref.length} bytes): the checkpoint is corrupted"
            )
        return data
