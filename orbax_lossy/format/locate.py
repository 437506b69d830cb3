"""Find the item directory a user means: a root, a step directory or an item directory."""

from __future__ import annotations

import os

from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.format.manifest import MANIFEST_NAME
from orbax_lossy.format.steps import TMP_SUFFIX, abspath, is_file, listdir, step_directories


def lossy_items(step_dir: os.PathLike | str) -> dict[str, str]:
    """Item directories of a step that hold a committed lossy manifest, by item name."""
    step_dir = os.fspath(step_dir)
    try:
        names = sorted(listdir(step_dir))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {
        n: os.path.join(step_dir, n)
        for n in names
        if TMP_SUFFIX not in n and is_file(os.path.join(step_dir, n, MANIFEST_NAME))
    }


def committed_steps(root: os.PathLike | str) -> dict[int, str]:
    """Step directories under ``root`` that hold at least one lossy item."""
    return {s: d for s, d in sorted(step_directories(root).items()) if lossy_items(d)}


def resolve_item_dir(
    path: os.PathLike | str, step: int | None = None, item: str | None = None
) -> str:
    """The item directory ``path`` names: itself, an item of a step, or a step of a root.

    A root resolves to ``step`` (default: the latest step holding a lossy item); a step
    directory to its lossy item (``item`` picks one when it holds several).
    """
    path = abspath(path)
    if is_file(os.path.join(path, MANIFEST_NAME)):
        if step is not None or item is not None:
            raise InvalidArgumentError(f"{path} is an item directory: --step/--item do not apply")
        return path
    items = lossy_items(path)
    if not items:
        steps = committed_steps(path)
        if not steps:
            raise InvalidArgumentError(
                f"{path} is not an orbax-lossy checkpoint root, step or item directory"
            )
        chosen = max(steps) if step is None else step
        if chosen not in steps:
            raise InvalidArgumentError(f"{path} has no step {step}; steps: {sorted(steps)}")
        items, path = lossy_items(steps[chosen]), steps[chosen]
    elif step is not None:
        raise InvalidArgumentError(f"{path} is a step directory: --step does not apply")
    if item is not None:
        if item not in items:
            raise InvalidArgumentError(f"{path} has no lossy item {item!r}; items: {sorted(items)}")
        return items[item]
    if len(items) > 1:
        raise InvalidArgumentError(
            f"{path} holds several lossy items {sorted(items)}; choose one with --item"
        )
    return next(iter(items.values()))
