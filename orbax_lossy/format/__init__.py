"""The on-disk format: envelopes, the chunk grid, payload files, the typed manifest, chains.

An item directory holds ``manifest.msgpack`` (written by the primary host in ``finalize``)
and ``data.p<K>.bin`` (payload pieces of process K). See ``docs/format.md``.
"""

from orbax_lossy.format.chain import walk_chain
from orbax_lossy.format.envelope import (
    FORMAT_VERSION,
    MAGIC,
    crc32,
    pack_envelope,
    read_envelope,
    unpack_envelope,
    write_envelope,
)
from orbax_lossy.format.grid import (
    Box,
    box_from_index,
    box_shape,
    chunk_shape_for,
    full_box,
    grid_pieces,
    intersect,
    local_slices,
)
from orbax_lossy.format.manifest import (
    DEFAULT_CHUNK_BYTES,
    MANIFEST_NAME,
    Header,
    LeafEntry,
    Manifest,
    ReferenceLink,
    read_manifest,
    write_manifest,
)
from orbax_lossy.format.payload import (
    PayloadReader,
    PayloadWriter,
    PieceRef,
    data_file_name,
    index_file_name,
)
from orbax_lossy.format.steps import final_path, root_of, step_directories, step_of

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "MANIFEST_NAME",
    "Box",
    "Header",
    "LeafEntry",
    "Manifest",
    "PayloadReader",
    "PayloadWriter",
    "PieceRef",
    "ReferenceLink",
    "box_from_index",
    "box_shape",
    "chunk_shape_for",
    "crc32",
    "data_file_name",
    "final_path",
    "full_box",
    "grid_pieces",
    "index_file_name",
    "intersect",
    "local_slices",
    "pack_envelope",
    "read_envelope",
    "read_manifest",
    "root_of",
    "step_directories",
    "step_of",
    "unpack_envelope",
    "walk_chain",
    "write_envelope",
    "write_manifest",
]
