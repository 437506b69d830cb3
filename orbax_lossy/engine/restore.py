"""The restore pipeline: walk the chain, match targets, read only needed pieces, decode.

Each selected leaf is read from the newest link that stores it without a reference (an
exact leaf from the newest step alone), then every later link's delta is decoded on device
in one jitted program per link. Leaves are matched across links by path, and each link must
agree on the leaf's shape, dtype, storage and key type.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from orbax_lossy.engine import device, reading
from orbax_lossy.errors import ChainError, InvalidArgumentError
from orbax_lossy.format import payload
from orbax_lossy.format.chain import walk_chain
from orbax_lossy.format.manifest import HOST_STORAGES, LeafEntry, Manifest
from orbax_lossy.treepaths import StoredPath, build_nested, flatten, path_str


@dataclasses.dataclass
class RestoredItem:
    """A restored tree, and what the handler needs to adopt it as its reference."""

    tree: Any
    item_dir: str
    manifest: Manifest
    values: list[Any]  # per stored leaf (None where not selected), before casting
    complete: bool  # every stored leaf was restored
    bytes_read: int


def _same_leaf(a: LeafEntry, b: LeafEntry) -> bool:
    return (a.shape, a.dtype, a.storage, a.key_impl) == (b.shape, b.dtype, b.storage, b.key_impl)


def _link_leaves(
    chain: list[tuple[str, Manifest]], selected: Sequence[LeafEntry]
) -> list[list[LeafEntry]]:
    """Per link, the entries of the selected leaves (matched by path, checked alike)."""
    out = []
    for link_dir, manifest in chain:
        entries = []
        for leaf in selected:
            j = manifest.index.get(leaf.path)
            if j is None:
                raise ChainError(f"{link_dir}: leaf {leaf.name!r} of the restored step is "
                                 "missing from this link of its chain")
            entry = manifest.leaves[j]
            if not _same_leaf(entry, leaf):
                raise ChainError(
                    f"{link_dir}: leaf {leaf.name!r} is {entry.storage} {entry.dtype} "
                    f"{entry.shape} here but {leaf.storage} {leaf.dtype} {leaf.shape} in the "
                    "restored step; the chain is inconsistent"
                )
            entries.append(entry)
        out.append(entries)
    return out


def _first_needed_links(per_link: list[list[LeafEntry]], n: int) -> list[int]:
    """Per selected leaf, the last link that stores it without a reference."""
    starts = [0] * n
    for position, entries in enumerate(per_link):
        for k, entry in enumerate(entries):
            if not entry.codec.needs_reference:
                starts[k] = position
    return starts


def _match_targets(
    item_dir: str, manifest: Manifest, target: Any
) -> tuple[list[int], list[Any], Any]:
    """Selected stored leaves, their targets and the target treedef (None: nested dicts)."""
    if target is None:
        return list(range(len(manifest.leaves))), [None] * len(manifest.leaves), None
    paths, leaves, treedef = flatten(target)
    by_name: dict[str, int | None] = {}
    for i, leaf in enumerate(manifest.leaves):
        by_name[leaf.name] = None if leaf.name in by_name else i  # None: ambiguous
    selected = []
    for p in paths:
        i = manifest.index.get(p)
        if i is None:
            i = by_name.get(path_str(p))  # dict keys and attributes alike, as Orbax does
        if i is None:
            raise InvalidArgumentError(
                f"restore target leaf {path_str(p)!r} is not in checkpoint {item_dir}"
            )
        selected.append(i)
    for p, leaf, i in zip(paths, leaves, selected, strict=True):
        stored = manifest.leaves[i].shape
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is not None and dtype is not None and jax.dtypes.issubdtype(
            dtype, jax.dtypes.prng_key
        ):  # a PRNG key target: compare its key-data shape with the stored one
            shape = jax.eval_shape(
                jax.random.key_data, jax.ShapeDtypeStruct(tuple(shape), dtype)
            ).shape
        if shape is not None and tuple(shape) != stored:
            raise InvalidArgumentError(
                f"leaf {path_str(p)!r}: target shape {tuple(shape)} != stored shape {stored} "
                f"in {item_dir}"
            )
    return selected, leaves, treedef


def _decode_link(
    link_dir: str,
    manifest: Manifest,
    entries: list[LeafEntry],
    targets: list[Any],
    previous: list[Any] | None,
    active: list[bool],
    reader: payload.PayloadReader,
    threads: int,
) -> list[Any]:
    device_k, plan, dtypes, shardings, fields, sides, refs = [], [], [], [], [], [], []
    out: list[Any] = [None] * len(entries)
    for k, leaf in enumerate(entries):
        if not active[k]:  # a later link stores this leaf whole: nothing to read here
            continue
        lw = f"{link_dir}: leaf {leaf.name!r}"
        codec = leaf.codec
        if leaf.storage in HOST_STORAGES:
            out[k] = reading.read_region(
                reader, leaf.pieces, codec, "raw", leaf.dtype, tuple((0, d) for d in leaf.shape),
                {}, lw,
            )
            continue
        sharding = reading.target_sharding(targets[k])
        field_arrays = {
            name: reading.assemble_field(
                reader, [p for p in leaf.pieces if p.field == name], codec, name, fdtype,
                leaf.shape, sharding, lw, threads,
            )
            for name, fdtype in codec.field_dtypes(leaf.dtype).items()
        }
        ref = None
        if codec.needs_reference:
            if previous is None or previous[k] is None:
                raise ChainError(f"{lw}: a delta leaf has no reference (chain starts here)")
            ref = previous[k]
        device_k.append(k)
        plan.append(codec)
        dtypes.append(leaf.dtype)
        shardings.append(sharding)
        fields.append(field_arrays)
        sides.append({name: jnp.asarray(v) for name, v in leaf.side.items()})
        refs.append(ref)
    if device_k:
        decoded = device.run_grouped(
            device.decode_tree,
            manifest.header.programs == "per_leaf",
            fields, sides, refs, plan=tuple(plan), dtypes=tuple(dtypes),
            shardings=tuple(shardings),
        )
        for k, v in zip(device_k, decoded, strict=True):
            out[k] = v
    return out


def restore_item(item_dir: os.PathLike | str, target: Any, threads: int) -> RestoredItem:
    """Restore one item directory onto ``target`` (a tree, or None for nested dicts)."""
    item_dir = os.path.abspath(os.path.normpath(os.fspath(item_dir)))
    chain = walk_chain(item_dir)
    final = chain[-1][1]
    selected, targets, treedef = _match_targets(item_dir, final, target)
    chosen = [final.leaves[i] for i in selected]
    per_link = _link_leaves(chain, chosen)
    starts = _first_needed_links(per_link, len(chosen))
    values: list[Any] | None = None
    bytes_read = 0
    for position, ((link_dir, manifest), entries) in enumerate(zip(chain, per_link,
                                                                  strict=True)):
        active = [position >= start for start in starts]
        if not any(active):
            continue
        reader = payload.PayloadReader(link_dir)
        values = _decode_link(link_dir, manifest, entries, targets, values, active, reader,
                              threads)
        bytes_read += reader.bytes_read
    assert values is not None
    out = []
    for k, leaf in enumerate(chosen):
        value = values[k]
        if leaf.key_impl:
            value = jax.random.wrap_key_data(value, impl=leaf.key_impl)
        out.append(reading.cast_to_target(value, targets[k], leaf))
    if treedef is None:
        tree = build_nested([leaf.path for leaf in chosen], out)
    else:
        tree = jax.tree_util.tree_unflatten(treedef, out)
    by_stored: list[Any] = [None] * len(final.leaves)
    for k, i in enumerate(selected):
        by_stored[i] = values[k]
    return RestoredItem(tree, item_dir, final, by_stored, len(set(selected)) == len(final.leaves),
                        bytes_read)


def metadata_tree(manifest: Manifest) -> Any:
    """Tree of ``jax.ShapeDtypeStruct`` of a saved item (PRNG keys as key arrays)."""
    leaves: list[Any] = []
    for leaf in manifest.leaves:
        if leaf.key_impl:
            leaves.append(jax.eval_shape(
                lambda s=leaf.shape, d=leaf.dtype, impl=leaf.key_impl:
                jax.random.wrap_key_data(jnp.zeros(s, d), impl=impl)))
        else:
            leaves.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    paths: list[StoredPath] = [leaf.path for leaf in manifest.leaves]
    return build_nested(paths, leaves)
