"""The partial-experts record and per-item state shared by the save and restore sides.

``__pec__/meta`` is a small ``uint8`` JSON leaf stored in every partial save (written by
:mod:`orbax_lossy.experts.partial`, read by :mod:`orbax_lossy.experts.restore`); ``_ItemState``
is what :class:`~orbax_lossy.experts.partial.PartialExperts` keeps per item between saves: the
rotation, the token counts and the per-expert mosaic (every expert's last reconstruction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from orbax_lossy.experts import accounting
from orbax_lossy.experts.rules import META_KEY
from orbax_lossy.format.manifest import LeafEntry, Manifest
from orbax_lossy.treepaths import StoredPath, build_nested

META_NAME = f"{META_KEY}/meta"
VERSION = 1


@dataclasses.dataclass
class _ItemState:
    """Per item: the layout, the rotation, the counts and the per-expert mosaic."""

    layout_sig: tuple
    k: int
    cursor: int
    counts: dict[str, accounting.GroupCounts]
    mosaic: dict[str, Any]  # unit key -> full stacked array, or {expert: leaf array}
    k_history: list[list[int]]
    restores: list[dict[str, Any]]
    saves: int = 0
    pending: list[tuple] = dataclasses.field(default_factory=list)  # published, not folded

    def copy(self) -> _ItemState:
        """A copy whose counts can be changed (mosaic arrays are immutable, shared)."""
        return dataclasses.replace(
            self, counts={g: c.copy() for g, c in self.counts.items()},
            mosaic={k: (dict(v) if isinstance(v, dict) else v) for k, v in self.mosaic.items()},
            k_history=[list(x) for x in self.k_history], restores=list(self.restores),
            pending=list(self.pending))


def _unit_key(group: str, index: int) -> str:
    return f"{group}#{index}"


def _assemble(paths: Sequence[StoredPath], leaves: Sequence[Any], meta: Any,
              wrap: bool) -> Any:
    """Nested dicts of ``paths`` plus ``__pec__/meta`` (under ``state`` if ``wrap``)."""
    if wrap:
        paths = [(("d", "state"), *p) for p in paths]
    tree = build_nested(list(paths), list(leaves)) if paths else {}
    if meta is not None:
        tree[META_KEY] = {"meta": meta}
    return tree


def _find(manifest: Manifest, name: str) -> LeafEntry | None:
    for leaf in manifest.leaves:
        if leaf.name == name:
            return leaf
    return None

