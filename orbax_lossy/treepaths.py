"""Pytree key paths: flatten a tree into (path, leaf) pairs and rebuild trees from paths.

A path is stored on disk as a list of ``[key type, key]`` pairs: ``"d"`` for a dict key
(str or int), ``"s"`` for a sequence index, ``"a"`` for an attribute name and ``"i"`` for a
flattened index. Restoring without a target tree rebuilds nested dicts (and lists for sequence
keys), like Orbax does; restoring with a target tree matches leaves by path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from orbax_lossy.errors import FormatError, InvalidArgumentError

StoredPath = tuple[tuple[str, Any], ...]


def encode_path(path: Sequence[Any]) -> StoredPath:
    """A JAX key path as stored on disk: ``(("d"|"s"|"a"|"i", key), ...)``."""
    out = []
    for entry in path:
        if isinstance(entry, DictKey):
            key = entry.key
            if not isinstance(key, (str, int)):
                key = str(key)
            out.append(("d", key))
        elif isinstance(entry, SequenceKey):
            out.append(("s", int(entry.idx)))
        elif isinstance(entry, GetAttrKey):
            out.append(("a", str(entry.name)))
        elif isinstance(entry, FlattenedIndexKey):
            out.append(("i", int(entry.key)))
        else:
            out.append(("d", str(entry)))
    return tuple(out)


def path_str(path: StoredPath) -> str:
    """Human-readable path such as ``params/Dense_0/kernel`` (used in errors and rules)."""
    try:
        return _path_str(path)
    except TypeError:  # an unhashable path (a list): joined each time
        return _path_str.__wrapped__(path)


@functools.lru_cache(maxsize=1 << 16)
def _path_str(path: StoredPath) -> str:
    """:func:`path_str`, once per path (a restore names every leaf of every link)."""
    return "/".join(str(k) for _, k in path) if path else "<root>"


def flatten(tree: Any, keep_none: bool = False) -> tuple[list[StoredPath], list[Any], Any]:
    """Leaves of ``tree`` with their stored paths, and the treedef.

    ``keep_none``: ``None`` nodes are leaves too (saved as ``"none"`` leaves and restored as
    ``None``); otherwise JAX's default drops them.
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=(lambda x: x is None) if keep_none else None
    )
    paths = [encode_path(p) for p, _ in with_path]
    if len(set(paths)) != len(paths):
        raise InvalidArgumentError("two leaves of the tree have the same key path")
    return paths, [leaf for _, leaf in with_path], treedef


def build_nested(paths: Sequence[StoredPath], leaves: Sequence[Any]) -> Any:
    """Nested dicts/lists from stored paths (the tree returned when no target is given)."""
    if len(paths) == 1 and not paths[0]:
        return leaves[0]
    root: dict[Any, Any] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if not path:
            raise FormatError("a root leaf cannot sit beside other leaves")
        node = root
        for _, key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise FormatError(f"path {path_str(path)} conflicts with another leaf")
        node[path[-1][1]] = leaf
    return _lists_from_sequence_dicts(root, paths)


def _lists_from_sequence_dicts(root: dict[Any, Any], paths: Sequence[StoredPath]) -> Any:
    seq_prefixes = set()
    for path in paths:
        for depth, (key_type, _) in enumerate(path):
            if key_type == "s":
                seq_prefixes.add(tuple(k for _, k in path[:depth]))

    def convert(node: Any, prefix: tuple[Any, ...]) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: convert(v, (*prefix, k)) for k, v in node.items()}
        if prefix in seq_prefixes and sorted(items) == list(range(len(items))):
            return [items[i] for i in range(len(items))]
        return items

    return convert(root, ())


#: How an empty node is restored without a target, as Orbax restores it: an empty mapping as
#: ``{}``, an empty list or tuple as ``[]``, any other empty node (optax's ``EmptyState()``,
#: an empty dataclass) as ``None``.
EMPTY_NODE_KINDS = ("dict", "list", "none")


def _is_empty_node(x: Any) -> bool:
    if x is None:
        return False
    return not jax.tree_util.tree_leaves(x)  # a node without leaves (a leaf is its own leaf)


def empty_nodes(tree: Any) -> list[tuple[StoredPath, str]]:
    """Paths of the tree's empty containers, with how each comes back (``EMPTY_NODE_KINDS``).

    Depends only on the tree's structure, so it is computed once per structure (``save()``
    calls it on the training thread).
    """
    if tree is None:
        return []
    return list(_empty_nodes_of(jax.tree_util.tree_structure(tree)))


@functools.lru_cache(maxsize=64)
def _empty_nodes_of(treedef: Any) -> tuple[tuple[StoredPath, str], ...]:
    skeleton = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    found = jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=_is_empty_node)[0]
    out = []
    for path, node in found:
        if not _is_empty_node(node):
            continue
        if isinstance(node, dict):
            container = "dict"
        elif isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            container = "list"
        else:
            container = "none"
        out.append((encode_path(path), container))
    return tuple(out)


def empty_value(container: str) -> Any:
    """The value an empty node restores as (``container`` from ``EMPTY_NODE_KINDS``)."""
    return {} if container == "dict" else [] if container == "list" else None
