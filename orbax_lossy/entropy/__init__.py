"""Entropy coding of byte-symbol streams (canonical length-limited Huffman, block layout)."""

from orbax_lossy.entropy.stream import decode_symbols, encode_symbols, order0_entropy_bits

__all__ = ["decode_symbols", "encode_symbols", "order0_entropy_bits"]
