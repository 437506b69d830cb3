"""Export a step as a plain Orbax checkpoint, readable without this library."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from orbax_lossy.engine.restore import restore_item
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.format.locate import resolve_item_dir
from orbax_lossy.format.steps import abspath, exists
from orbax_lossy.threads import available_cores


def _plain(value: Any) -> Any:
    """A leaf Orbax's StandardSave accepts (PRNG keys as their key data)."""
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    return value


def export_step(
    source: os.PathLike | str,
    destination: os.PathLike | str,
    *,
    step: int | None = None,
    item: str | None = None,
    overwrite: bool = False,
) -> str:
    """Write the restored state of a step to ``destination`` as a plain Orbax checkpoint.

    ``source`` is a checkpoint root (latest step, or ``step``), a step directory or an item
    directory. The result is what ``ocp.StandardCheckpointer().restore(destination)`` reads:
    the same tree as a restore without a target (PRNG keys as their uint32 key data). Returns
    the item directory that was exported.
    """
    import orbax.checkpoint as ocp

    item_dir = resolve_item_dir(source, step=step, item=item)
    destination = abspath(destination)
    if exists(destination) and not overwrite:
        raise InvalidArgumentError(f"{destination} exists; pass overwrite=True to replace it")
    tree = restore_item(item_dir, None, threads=available_cores()).tree
    tree = jax.tree_util.tree_map(_plain, tree)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(destination, tree, force=overwrite)
    return item_dir
