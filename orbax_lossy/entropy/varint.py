"""Unsigned LEB128 varints, the one implementation every byte stream of the library uses.

A value is written 7 bits a byte, least significant group first, the high bit of each byte
set when another byte follows. Readers accept at most :data:`MAX_BYTES` bytes (values below
``2**63``) and only the canonical (shortest) encoding: a last byte of zero after the first
is rejected, so every value has exactly one byte string.
"""

from __future__ import annotations

from typing import Protocol

from orbax_lossy.errors import FormatError, TruncatedError


class ByteSequence(Protocol):
    """What :func:`read_uvarint` reads: bytes, bytearray, memoryview or a uint8 array."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> int: ...


#: longest varint a reader accepts
MAX_BYTES = 9


def encode_uvarint(value: int) -> bytes:
    """The canonical LEB128 bytes of a non-negative int below ``2**63``."""
    if value < 0 or value >> (7 * MAX_BYTES):
        raise ValueError(f"uvarint value out of range 0..2**63-1: {value}")
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if not value:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def read_uvarint(buf: ByteSequence, pos: int, what: str, stream: str = "stream") -> tuple[int, int]:
    """Read the varint at ``buf[pos]``; returns ``(value, position after it)``.

    ``buf`` is any indexable byte sequence (bytes, memoryview, uint8 array). ``what`` and
    ``stream`` name the field and its stream in errors. Raises TruncatedError when ``buf``
    ends inside the varint, FormatError when it is longer than 9 bytes or not canonical.
    """
    value = 0
    for i in range(MAX_BYTES):
        if pos + i >= len(buf):
            raise TruncatedError(f"{stream} ends inside {what}")
        b = int(buf[pos + i])
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            if i and b == 0:
                raise FormatError(f"non-canonical varint for {what}")
            return value, pos + i + 1
    raise FormatError(f"varint for {what} is longer than {MAX_BYTES} bytes")
