"""Entropy coding of byte-symbol streams (canonical length-limited Huffman, block layout)."""

from orbax_lossy.entropy.stream import decode_symbols, encode_symbols, order0_entropy_bits
from orbax_lossy.entropy.varint import encode_uvarint, read_uvarint

__all__ = [
    "decode_symbols",
    "encode_symbols",
    "encode_uvarint",
    "order0_entropy_bits",
    "read_uvarint",
]
