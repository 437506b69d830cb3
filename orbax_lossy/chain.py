"""Delta-chain bookkeeping for retention: a preservation policy that keeps chains whole.

A delta checkpoint can only be restored while every step it depends on (its reference, that
step's reference, ... down to the base) still exists. :class:`ChainPreservationPolicy` wraps
any Orbax preservation policy (``LatestN``, ``EveryNSteps``, ``BestN``, ...) and additionally
keeps every step that a kept step needs. Dependencies come from the handler's memory (the
step in flight is not on disk yet) and otherwise from the manifests on disk, so the policy
works after a restart. It only ever *adds* steps to the kept set; it never deletes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

from orbax_lossy import format as fmt
from orbax_lossy.errors import LossyError
from orbax_lossy.handler import LossyCheckpointHandler, read_manifest

_TMP = ".orbax-checkpoint-tmp"


def step_directories(root: str) -> dict[int, str]:
    """Committed-looking step directories under ``root`` by step number."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        if _TMP in name:
            continue
        m = re.search(r"(\d+)$", name)
        if m and os.path.isdir(os.path.join(root, name)):
            out[int(m.group(1))] = os.path.join(root, name)
    return out


def dependency_from_disk(step_dir: str, item_name: str) -> int | None:
    """The reference step recorded in a step's manifest (None for a base or unreadable)."""
    item_dir = os.path.join(step_dir, item_name)
    if not os.path.exists(os.path.join(item_dir, fmt.MANIFEST_NAME)):
        return None
    try:
        manifest = read_manifest(item_dir)
    except LossyError:
        return None
    ref = manifest.get("reference")
    return int(ref["step"]) if ref and ref.get("step") is not None else None


@dataclasses.dataclass
class ChainPreservationPolicy:
    """Keeps what ``inner`` keeps, plus every step a kept delta checkpoint depends on.

    Args:
      inner: any Orbax preservation policy.
      handler: the lossy handler the manager uses (knows the step being saved).
      directory: the manager's root directory.
      item_name: the item the handler saves (``"default"`` for single-item managers).
    """

    inner: Any
    handler: LossyCheckpointHandler
    directory: str | os.PathLike
    item_name: str = "default"

    def __post_init__(self) -> None:
        self.handler.protect_chains(self.directory)

    def dependency(self, step: int, step_dirs: dict[int, str] | None = None) -> int | None:
        root = os.path.normpath(os.fspath(self.directory))
        try:
            return self.handler.dependency_of(root, step)
        except KeyError:
            pass
        step_dirs = step_directories(root) if step_dirs is None else step_dirs
        if step not in step_dirs:
            return None
        return dependency_from_disk(step_dirs[step], self.item_name)

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> Sequence[bool]:
        keep = list(self.inner.should_preserve(checkpoints, context=context))
        position = {c.step: i for i, c in enumerate(checkpoints)}
        step_dirs = step_directories(os.fspath(self.directory))
        for i, checkpoint in enumerate(checkpoints):
            if not keep[i]:
                continue
            step, seen = checkpoint.step, set()
            while step not in seen:
                seen.add(step)
                dep = self.dependency(step, step_dirs)
                if dep is None or dep not in position:
                    break
                keep[position[dep]] = True
                step = dep
        return keep
