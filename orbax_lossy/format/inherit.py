"""A delta manifest's leaf entries stored as differences from its chain base's (format 4).

A delta's leaf table repeats its base's almost word for word: the same paths, storages,
shapes, dtypes, chunk grids, roles and sharding strings; only checksums, offsets, lengths,
side values and measured errors change (and codecs, where bases use other codecs). Since
format version 4 a delta's manifest names its base in the header key ``inherits``
(``{"relpath", "step", "save_id", "crc32"}``, ``crc32`` of the base manifest's inflated
msgpack body), and every leaf entry that lacks a ``"path"`` is a *difference*: it holds only
the keys whose values differ from the base's entry at the same position (a differing value
replaces the base's whole, except the list of pieces, which is differenced piece by piece when
it has as many pieces as the base's; ``stored_bytes``, the sum of the piece lengths, is left
out and recomputed). An entry with a ``"path"`` is complete and inherits
nothing. On the held-out CNN benchmark (37 leaves) a delta manifest fell from 2,097 to 1,380
bytes.

A delta is never restorable without its base, so this adds no dependency a restore did not
have; the header stays readable alone (retention reads only headers). The writer checks that
every difference merges back to the entry it stands for, and stores the entry whole where it
would not (a key the base has and the entry lacks). A delta whose reference is an older
format's delta, or whose base manifest cannot be read at commit time, is written whole.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

from orbax_lossy.errors import ChainError, LossyError, MissingStepError
from orbax_lossy.format.envelope import crc32, read_envelope_bytes, unpack_body
from orbax_lossy.format.schema import MANIFEST_NAME
from orbax_lossy.format.steps import abspath, is_remote, lexists, normpath, root_of

INHERITS_KEY = "inherits"
STORED_BYTES = "stored_bytes"


def maps_alike(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are lists of maps of one length (a leaf's pieces), which
    :func:`merged` merges map by map."""
    return (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
            and all(isinstance(x, dict) for x in a + b))


def difference(entry: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``entry`` whose values differ from ``base``'s; a list of maps of the same
    length as the base's (the pieces) as the differing keys of each map."""
    out: dict[str, Any] = {}
    for k, v in entry.items():
        if k not in base:
            out[k] = v
        elif base[k] != v:
            out[k] = ([{kk: vv for kk, vv in x.items() if kk not in y or y[kk] != vv}
                       for x, y in zip(v, base[k], strict=True)]
                      if maps_alike(v, base[k]) else v)
    return out


def merged(diff: dict[str, Any], base: dict[str, Any], copy: bool = True) -> dict[str, Any]:
    """Invert :func:`difference`: ``base`` with ``diff`` laid over it (with ``copy``, new
    containers throughout, so neither argument is shared with the result; without, the
    result shares the base's values and must not be modified)."""
    c = _copy if copy else _same
    out = {k: c(v) for k, v in base.items()}
    for k, v in diff.items():
        out[k] = ([{**c(y), **c(x)} for x, y in zip(v, base[k], strict=True)]
                  if k in base and maps_alike(v, base[k]) else c(v))
    return out


def _same(value: Any) -> Any:
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def compact(leaves: list[dict[str, Any]], base_leaves: list[Any]) -> list[dict[str, Any]]:
    """Each leaf entry as its difference from the base's entry at its position, where that
    entry has the same path and the difference merges back exactly; else whole."""
    out = []
    for i, entry in enumerate(leaves):
        base = base_leaves[i] if i < len(base_leaves) else None
        if isinstance(base, dict) and base.get("path") == entry["path"]:
            diff = difference(entry, base)
            diff.pop(STORED_BYTES, None)  # the sum of the piece lengths: restored on reading
            if _expanded(diff, base, copy=False) == entry:
                out.append(diff)
                continue
        out.append(entry)
    return out


def merged_entry(diff: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The complete entry a difference stands for, sharing the base's values (not to be
    modified)."""
    return _expanded(diff, base, copy=False)


def _expanded(diff: dict[str, Any], base: dict[str, Any], copy: bool = True) -> dict[str, Any]:
    """The complete entry a difference stands for (``stored_bytes`` recomputed)."""
    entry = merged(diff, base, copy)
    pieces = entry.get("pieces")
    if STORED_BYTES in entry and isinstance(pieces, list):
        lengths = [p.get("length") for p in pieces if isinstance(p, dict)]
        if all(isinstance(n, int) for n in lengths):
            entry[STORED_BYTES] = sum(lengths)
    return entry


def expand(leaves: list[Any], base_leaves: list[Any], where: str,
           copy: bool = True) -> list[Any]:
    """Every entry complete: differences (entries without a path) merged with the base's
    (sharing the base's values unless ``copy``)."""
    out = []
    for i, entry in enumerate(leaves):
        if isinstance(entry, dict) and "path" not in entry:
            if i >= len(base_leaves) or not isinstance(base_leaves[i], dict):
                raise ChainError(f"{where}: leaf entry {i} inherits from the base's entry {i}, "
                                 f"which the base (of {len(base_leaves)} leaves) does not have")
            entry = _expanded(entry, base_leaves[i], copy)
        out.append(entry)
    return out


def _body_of(directory: str, where: str) -> tuple[bytes, dict[str, Any]]:
    """(inflated body bytes, decoded body) of ``directory``'s manifest."""
    path = os.path.join(directory, MANIFEST_NAME)
    raw = read_envelope_bytes(path, "manifest")
    body = unpack_body(raw, path)
    if not isinstance(body, dict):
        raise ChainError(f"{where}: base manifest {path} is not a map")
    return raw, body


def link_for(item_dir: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[Any]] | None:
    """The ``inherits`` link and the base's leaf entries for a delta about to be written in
    ``item_dir`` (the tmp directory of its commit works: relative paths are the same), or
    None where the leaf table must be written whole."""
    reference = body.get("reference")
    if body.get("kind") != "delta" or not isinstance(reference, dict):
        return None
    rel = reference.get("relpath")
    if not isinstance(rel, str):
        return None
    try:
        raw, ref = _body_of(normpath(os.path.join(item_dir, rel)), item_dir)
        if ref.get("kind") == "base":
            leaves = ref.get("leaves")
            link = {"relpath": rel, "step": ref.get("step"), "save_id": ref.get("save_id"),
                    "crc32": crc32(raw)}
        else:
            ref_link = ref.get(INHERITS_KEY)
            if not isinstance(ref_link, dict) or not isinstance(ref_link.get("relpath"), str):
                return None  # the reference was written whole (format <= 3)
            base_rel = os.path.normpath(os.path.join(rel, ref_link["relpath"]))
            link = {**ref_link, "relpath": base_rel}
            leaves = _base_leaves(normpath(os.path.join(item_dir, base_rel)), link, item_dir)
    except (OSError, LossyError):
        return None
    return (link, leaves) if isinstance(leaves, list) else None


def pack(item_dir: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (a whole manifest body) with its leaf table inheriting from the chain base."""
    found = link_for(item_dir, body)
    if found is None:
        return body
    link, base_leaves = found
    return {**body, INHERITS_KEY: link, "leaves": compact(body["leaves"], base_leaves)}


def unpack(item_dir: str, body: Any, where: str, copy: bool = True) -> Any:
    """A manifest body with every leaf entry complete (the ``inherits`` key removed).
    Without ``copy`` the entries share values with a cached base and must not be modified."""
    found = split(item_dir, body, where)
    if found is None:
        return body
    out, leaves, base_leaves, _ = found
    out["leaves"] = expand(leaves, base_leaves, where, copy)
    return out


def split(item_dir: str, body: Any, where: str
          ) -> tuple[dict[str, Any], list[Any], list[Any], tuple[Any, ...] | None] | None:
    """For a body that inherits from its base (else None): the body without the ``inherits``
    key, its own leaf entries (differences not merged), the base's leaf entries (not to be
    modified) and the key under which those are cached (None where they are not; see
    :func:`expand` for how the two merge)."""
    if not isinstance(body, dict) or INHERITS_KEY not in body:
        return None
    link = body[INHERITS_KEY]
    if (not isinstance(link, dict) or not isinstance(link.get("relpath"), str)
            or not isinstance(link.get("crc32"), int)):
        raise ChainError(f"{where}: malformed base link {str(link)[:200]}")
    leaves = body.get("leaves")
    if not isinstance(leaves, list):
        raise ChainError(f"{where}: leaf table is not a list")
    out = {k: v for k, v in body.items() if k != INHERITS_KEY}
    base_leaves, key = _base_leaves_keyed(_base_dir(item_dir, link), link, where)
    return out, leaves, base_leaves, key


def check_base(item_dir: str, link: dict[str, Any], where: str) -> None:
    """Raise as :func:`split` would if the base ``link`` names is missing or has changed
    (for a delta whose entries were merged with it before)."""
    _base_leaves_keyed(_base_dir(item_dir, link), link, where)


def _base_dir(item_dir: str, link: dict[str, Any]) -> str:
    from orbax_lossy.format.chain import reference_dir  # chain imports the manifest module

    return reference_dir(abspath(item_dir), link["relpath"], root_of(abspath(item_dir)))


# Bases read lately, by (manifest path, size, mtime, inode, link): a chain's deltas share one
# base, which a restore would otherwise read and decode once per link (a 360-leaf 10-link
# chain: walk_chain 250 -> 300-420 ms without this). A rewritten file has another mtime.
_BASES: collections.OrderedDict[tuple[Any, ...], list[Any]] = collections.OrderedDict()
_BASES_LOCK = threading.Lock()
_BASES_KEPT = 2
#: larger bases (inflated manifest bytes; ~10k leaves) are not kept: their decoded entries
#: would hold 10-20x as much memory for the life of the process
_BASE_CACHE_BYTES = 4 << 20


def _base_leaves(base_dir: str, link: dict[str, Any], where: str) -> list[Any]:
    """The leaf entries of the base ``link`` names, checked against it (not to be modified)."""
    return _base_leaves_keyed(base_dir, link, where)[0]


def _base_leaves_keyed(base_dir: str, link: dict[str, Any], where: str
                       ) -> tuple[list[Any], tuple[Any, ...] | None]:
    """:func:`_base_leaves`, and the cache key they are kept under (None: not kept)."""
    path = os.path.join(base_dir, MANIFEST_NAME)
    if not lexists(path):
        raise MissingStepError(
            f"{where}: its leaf table is stored against the manifest of step {link.get('step')} "
            f"({base_dir}), which is missing; the chain is broken", step=link.get("step"))
    key: tuple[Any, ...] | None = None
    if not is_remote(path):
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns, st.st_ino, link["crc32"], link.get("save_id"))
        with _BASES_LOCK:
            if key in _BASES:
                _BASES.move_to_end(key)
                return _BASES[key], key
    raw, base = _body_of(base_dir, where)
    if crc32(raw) != link["crc32"] or base.get("save_id") != link.get("save_id"):
        raise ChainError(f"{where}: its leaf table is stored against the manifest of step "
                         f"{link.get('step')} ({base_dir}), which has changed since (replaced "
                         "or rewritten checkpoint)")
    leaves = base.get("leaves")
    if not isinstance(leaves, list):
        raise ChainError(f"{where}: the leaf table of its base {base_dir} is not a list")
    if key is not None and len(raw) <= _BASE_CACHE_BYTES:
        with _BASES_LOCK:
            _BASES[key] = leaves
            while len(_BASES) > _BASES_KEPT:
                _BASES.popitem(last=False)
        return leaves, key
    return leaves, None
