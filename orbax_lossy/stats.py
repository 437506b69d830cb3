"""Per-leaf statistics recorded with every save, readable without touching payloads."""

from __future__ import annotations

import math
import os
from typing import Any

from orbax_lossy.format.manifest import read_manifest


def checkpoint_stats(item_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """One row per leaf of a saved item (``<root>/<step>/<item>``).

    Keys: ``path``, ``shape``, ``dtype``, ``role``, ``codec`` (the config the policy chose),
    ``raw_bytes``, ``stored_bytes``, ``ratio`` and ``rel_error`` (``||recon - value|| /
    ||value||`` measured on device at save time).
    """
    manifest = read_manifest(item_dir)
    rows = []
    for leaf in manifest.leaves:
        stored = leaf.stored_bytes
        rows.append(
            {
                "path": leaf.name,
                "shape": leaf.shape,
                "dtype": leaf.dtype.name,
                "role": leaf.role,
                "codec": dict(leaf.codec_config),
                "raw_bytes": leaf.raw_bytes,
                "stored_bytes": stored,
                "ratio": leaf.raw_bytes / stored if stored else math.inf,
                "rel_error": leaf.rel_error,
            }
        )
    return rows
