"""Per-leaf statistics recorded with every save, readable without touching payloads."""

from __future__ import annotations

import math
import os
from typing import Any

import jax.numpy as jnp

from orbax_lossy.handler import read_manifest
from orbax_lossy.treepaths import path_str


def checkpoint_stats(item_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """One row per leaf of a saved item (``<root>/<step>/<item>``).

    Keys: ``path``, ``shape``, ``dtype``, ``role``, ``codec`` (the config the policy chose),
    ``raw_bytes``, ``stored_bytes``, ``ratio`` and ``rel_error`` (``||recon - value|| /
    ||value||`` measured on device at save time).
    """
    manifest = read_manifest(item_dir)
    rows = []
    for leaf in manifest["leaves"]:
        raw = math.prod(leaf["shape"]) * jnp.dtype(leaf["dtype"]).itemsize
        stored = sum(p["length"] for p in leaf.get("pieces", []))
        rows.append(
            {
                "path": path_str(tuple(tuple(p) for p in leaf["path"])),
                "shape": tuple(leaf["shape"]),
                "dtype": leaf["dtype"],
                "role": leaf.get("role"),
                "codec": leaf["codec"],
                "raw_bytes": raw,
                "stored_bytes": stored,
                "ratio": raw / stored if stored else math.inf,
                "rel_error": float(leaf.get("rel_error", 0.0)),
            }
        )
    return rows
