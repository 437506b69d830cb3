"""The fixed chunk grid of a global array, and boxes (per-axis ``[start, stop)`` ranges).

The grid depends only on the global shape, the item size and the target chunk size, never on
the sharding the array had when it was saved, so any target sharding can read what it needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from orbax_lossy.errors import FormatError

Box = tuple[tuple[int, int], ...]


def chunk_shape_for(shape: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """Chunk shape of the fixed grid of a global array.

    The largest dimension is halved (rounding up) until a chunk holds at most
    ``target_bytes``; ties go to the leading dimension. Chunks are therefore close to cubes,
    so a restore that slices any axis reads roughly the fraction of the payload it needs.
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
        first = (start // c) * c
        ranges.append(
            [(max(start, cell), min(stop, cell + c)) for cell in range(first, stop, c)]
        )
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


def full_box(shape: Sequence[int]) -> Box:
    """The box of a whole array."""
    return tuple((0, int(d)) for d in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_shape(box: Box) -> tuple[int, ...]:
    """Shape of the region a box covers."""
    return tuple(stop - start for start, stop in box)


def box_inside(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` lies inside an array of ``shape``."""
    return len(box) == len(shape) and all(
        0 <= a < b <= d or (a == b == 0 == d) for (a, b), d in zip(box, shape, strict=True)
    )


def within_one_chunk(box: Box, chunk: Sequence[int]) -> bool:
    """Whether ``box`` lies inside a single cell of the chunk grid."""
    return len(box) == len(chunk) and all(
        b <= a or (a // c) == ((b - 1) // c) for (a, b), c in zip(box, chunk, strict=True)
    )


def local_slices(box: Box, within: Box) -> tuple[slice, ...]:
    """Slices that select ``box`` inside an array that holds region ``within``."""
    return tuple(slice(s - w, e - w) for (s, e), (w, _) in zip(box, within, strict=True))


def split_units(shards, axes: Sequence[int]) -> list:
    """``(box, host array)`` shards cut into boxes of extent 1 along ``axes``.

    The chunk grid of a leaf follows from its shape alone; a writer may still cut its pieces
    finer (pieces tile a cell, :meth:`LeafEntry.check_coverage`). Partial experts cut the held
    slot leaves so along their expert (and layer) axis: every piece belongs to one expert of one
    layer, and a restore that needs one expert reads only that expert's pieces.
    """
    out = list(shards)
    for axis in axes:
        cut = []
        for box, host in out:
            start, stop = box[axis]
            if stop - start <= 1:
                cut.append((box, host))
                continue
            for i in range(start, stop):
                sub = (*box[:axis], (i, i + 1), *box[axis + 1:])
                index = (slice(None),) * axis + (slice(i - start, i - start + 1),)
                cut.append((sub, host[index]))
        out = cut
    return out
