"""Walking a delta chain from a step back to its base, with every link's identity checked.

A link is accepted only if its manifest's step matches its directory, it is the step and the
save its successor recorded, and its path stays inside the checkpoint root (relative,
normalised, no symlink leaving the root; on an object store, where there are no symlinks,
the check is lexical). See ``docs/format.md`` for what is and is not detected.
"""

from __future__ import annotations

import os

from orbax_lossy.errors import ChainError, FormatError, MissingStepError
from orbax_lossy.format.manifest import MANIFEST_NAME, Manifest, read_manifest
from orbax_lossy.format.steps import abspath, inside, is_remote, lexists, normpath, root_of, step_of

MAX_CHAIN = 100_000


def _real_inside(target: str, root: str) -> bool:
    """Whether ``target`` and its manifest stay in ``root`` with symlinks resolved (local)."""
    if is_remote(root):  # object stores have no symlinks: the lexical check is the whole check
        return True
    real_root = os.path.realpath(root)
    return (inside(os.path.realpath(target), real_root)
            and inside(os.path.realpath(os.path.join(target, MANIFEST_NAME)), real_root))


def reference_dir(item_dir: str, relpath: str, root: str) -> str:
    """The item directory a reference link names, confined to ``root``."""
    if (os.path.isabs(relpath) or "\x00" in relpath or is_remote(relpath)
            or relpath != os.path.normpath(relpath)):
        raise ChainError(f"{item_dir}: reference path {relpath!r} is not a normalised "
                         "relative path")
    target = normpath(os.path.join(item_dir, relpath))
    if not inside(target, root) or root_of(target) != root or not _real_inside(target, root):
        raise ChainError(f"{item_dir}: reference {relpath!r} leaves the checkpoint root {root} "
                         "(or is not an item directory of a step in it)")
    return target


def walk_chain(item_dir: os.PathLike | str) -> list[tuple[str, Manifest]]:
    """``(item dir, manifest)`` from the chain's base to ``item_dir``."""
    current = abspath(item_dir)
    root = root_of(current)
    chain: list[tuple[str, Manifest]] = []
    seen: set[str] = set()
    while True:
        manifest_path = os.path.join(current, MANIFEST_NAME)
        if not lexists(manifest_path):
            if chain:
                prev = chain[-1][1].header
                raise MissingStepError(
                    f"step {prev.step} depends on step {step_of(current)}, whose checkpoint "
                    f"{current} is missing; the chain is broken",
                    step=step_of(current),
                )
            raise FormatError(f"{manifest_path} is missing: not a committed checkpoint")
        manifest = read_manifest(current)
        header = manifest.header
        dir_step = step_of(current)
        if chain and header.step is not None and dir_step is None:
            raise ChainError(f"{current}: a reference must be a step directory of the root")
        if header.step is not None and dir_step is not None and header.step != dir_step:
            raise ChainError(f"{current}: manifest is of step {header.step}, its directory of "
                             f"step {dir_step} (moved or swapped checkpoint)")
        if chain:
            link = chain[-1][1].header.reference
            assert link is not None
            if link.step is not None and header.step != link.step:
                raise ChainError(f"{chain[-1][0]}: references step {link.step} but "
                                 f"{current} holds step {header.step}")
            if (link.save_id is None and header.save_id is not None
                    and chain[-1][1].header.save_id is not None):
                raise ChainError(f"{chain[-1][0]}: its reference records no save id, but the "
                                 f"writer records them (a rewritten manifest)")
            if link.save_id is not None and header.save_id != link.save_id:
                raise ChainError(f"{chain[-1][0]}: its reference {current} is not the save it "
                                 "was encoded against (replaced or rewritten checkpoint)")
        chain.append((current, manifest))
        if current in seen or len(chain) > MAX_CHAIN:
            raise ChainError(f"{current}: the delta chain loops")
        seen.add(current)
        if header.is_base or header.reference is None:
            break
        current = reference_dir(current, header.reference.relpath, root)
    chain.reverse()
    return chain
