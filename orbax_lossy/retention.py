"""Retention for delta chains: keep what an Orbax policy keeps, plus everything it needs.

A delta checkpoint can only be restored while every step it depends on (its reference, that
step's reference, ... down to a base) still exists. :class:`ChainPreservationPolicy` wraps any
Orbax preservation policy (``LatestN``, ``EveryNSteps``, ``BestN``, ``AnyPreservationPolicy``...)
and additionally keeps every step a kept step needs. It only ever *adds* steps to the kept set.

Dependencies come from the handlers' memory (the step being saved is not on disk yet when Orbax
decides what to delete) and otherwise from the manifests on disk, read from every item directory
of a step that holds a lossy manifest, whatever the item is called. So the policy works for
single-item managers, ``Composite`` items of any name, several lossy items per step, and after a
restart.

:func:`legacy_preservation_policy` turns ``CheckpointManagerOptions``' legacy delete options
(``max_to_keep``, ``keep_period``, ``keep_time_interval``, ``best_fn``) into the preservation
policy Orbax itself builds from them. :func:`chain_dependencies` and :func:`kept_for_chains`
report what chains cost on disk.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import orbax.checkpoint as ocp
from etils import epath

from orbax_lossy.errors import LossyError
from orbax_lossy.format.locate import lossy_items
from orbax_lossy.format.manifest import MANIFEST_NAME, read_manifest_header
from orbax_lossy.format.steps import exists, is_remote, step_directories

if TYPE_CHECKING:
    from orbax_lossy.handler import LossyCheckpointHandler

_P = ocp.checkpoint_managers

__all__ = [
    "ChainPreservationPolicy",
    "chain_dependencies",
    "kept_for_chains",
    "legacy_preservation_policy",
]


# --------------------------------------------------------------------------- disk
# Step directories and lossy items are found as everywhere else (orbax_lossy.format.steps and
# .locate): local roots with OS calls, gs:// and s3:// roots through etils.epath.


def dependencies_from_disk(
    step_dir: str | os.PathLike, item_names: Iterable[str] | None = None
) -> set[int]:
    """Steps that the lossy items of one step directory reference (empty for bases).

    Every item subdirectory holding a lossy manifest counts, unless ``item_names`` restricts
    the scan. Unreadable manifests count as no dependency (their step is not restorable anyway).
    """
    step_path = os.fspath(step_dir)
    names = None if item_names is None else tuple(item_names)
    cached = _STEP_CACHE.get((step_path, names))
    if cached is not None and _fingerprint(step_path) == cached[0]:
        return set(cached[1])
    before = _fingerprint(step_path)
    deps = _step_dependencies(step_path, names)
    if before is not None and _fingerprint(step_path) == before:
        if len(_STEP_CACHE) >= _DEPENDENCY_CACHE_SIZE:
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
        _STEP_CACHE[(step_path, names)] = (before, frozenset(deps))
    return deps


#: per (step directory, item names): (fingerprint, dependencies); see :func:`_fingerprint`
_STEP_CACHE: dict[tuple[str, tuple[str, ...] | None], tuple[tuple, frozenset[int]]] = {}


def _fingerprint(step_path: str) -> tuple | None:
    """Modification times of a local step directory and of its subdirectories (None: not
    cacheable). Adding or removing an item changes the first, a manifest appearing in an item
    changes the item's, so an unchanged fingerprint means unchanged dependencies; checking
    it costs a few ``stat`` calls instead of listing items and reading manifests."""
    if is_remote(step_path):
        return None
    try:
        with os.scandir(step_path) as entries:
            subdirs = sorted((e.name, e.stat().st_mtime_ns) for e in entries
                             if e.is_dir(follow_symlinks=False))
        return (os.stat(step_path).st_mtime_ns, tuple(subdirs))
    except OSError:
        return None


def _step_dependencies(step_path: str, item_names: tuple[str, ...] | None) -> set[int]:
    if item_names is None:
        items = list(lossy_items(step_path).values())
    else:
        items = [os.path.join(step_path, n) for n in item_names
                 if exists(os.path.join(step_path, n, MANIFEST_NAME))]
    deps: set[int] = set()
    for item in items:
        deps.update(_manifest_dependencies(item))
    return deps


# A committed manifest never changes: its dependencies are read once per file version, not
# at every save (retention runs on Orbax's save path; re-parsing every kept step's manifest
# there cost more than the whole lossy save).
_DEPENDENCY_CACHE: dict[tuple[str, int, int], tuple[int, ...]] = {}
_DEPENDENCY_CACHE_SIZE = 4096


def _manifest_dependencies(item_dir: str) -> tuple[int, ...]:
    """``depends_on`` of one item's manifest (cached by path, size and mtime; an object
    store's manifest is read every time)."""
    key = None
    if not is_remote(item_dir):
        try:
            st = os.stat(os.path.join(item_dir, MANIFEST_NAME))
            key = (item_dir, st.st_size, st.st_mtime_ns)
        except OSError:  # missing: read_manifest says so
            pass
    if key is not None and key in _DEPENDENCY_CACHE:
        return _DEPENDENCY_CACHE[key]
    try:
        deps = read_manifest_header(item_dir).depends_on
    except (LossyError, OSError):
        return ()  # unreadable: its step is not restorable anyway
    if key is not None:
        if len(_DEPENDENCY_CACHE) >= _DEPENDENCY_CACHE_SIZE:
            _DEPENDENCY_CACHE.pop(next(iter(_DEPENDENCY_CACHE)))
        _DEPENDENCY_CACHE[key] = deps
    return deps


# --------------------------------------------------------------------------- policy


@dataclasses.dataclass
class ChainPreservationPolicy:
    """Keeps what ``inner`` keeps, plus every step a kept delta checkpoint depends on.

    Args:
      inner: any Orbax preservation policy.
      handler: the lossy handler(s) the manager uses (one, or a sequence when several lossy
        items have their own handlers). Each is told that ``directory`` keeps its chains
        (``protect_chains``), which lets it write deltas there.
      directory: the manager's root directory.
      item_name: optionally, the only item whose manifests are read from disk (by default
        every item directory holding a lossy manifest counts).
    """

    inner: Any
    handler: LossyCheckpointHandler | Sequence[LossyCheckpointHandler]
    directory: str | os.PathLike
    item_name: str | None = None
    #: After each decision: step kept only as a dependency -> the kept steps that need it.
    last_kept_for_chains: dict[int, list[int]] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )
    _last_kept: set[int] | None = dataclasses.field(default=None, init=False, repr=False)
    _warned: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.inner, ChainPreservationPolicy):
            self.inner = self.inner.inner
        if not self.handlers:
            raise TypeError("ChainPreservationPolicy needs at least one lossy handler")
        for h in self.handlers:
            h.protect_chains(self.directory)

    @property
    def handlers(self) -> list[LossyCheckpointHandler]:
        """``handler`` as a list (a list or tuple of handlers, else the one handler)."""
        h = self.handler
        if isinstance(h, (list, tuple)):
            return list(h)
        # a lone handler; LossyCheckpointHandler is only imported for type checking
        return [cast("LossyCheckpointHandler", h)]

    def _memory(self, step: int) -> tuple[int, set[int]]:
        """(how many items of ``step`` the handlers know, the steps those items need)."""
        known, deps = 0, set()
        for h in self.handlers:
            try:
                items = h.dependencies_of(os.fspath(self.directory), step)
            except KeyError:
                continue
            if self.item_name is not None:
                items = {k: v for k, v in items.items() if k == self.item_name}
            known += len(items)
            for steps in items.values():
                deps |= steps
        return known, deps

    def dependencies(
        self, step: int, step_dirs: Mapping[int, str] | None = None
    ) -> set[int]:
        """Steps that ``step`` directly depends on (memory of every handler, then disk).

        With one lossy item (``item_name``) that a handler saved or restored in this process,
        its memory is the manifest's header: nothing is read (this runs inside ``save()``).
        """
        known, deps = self._memory(step)
        if known and self.item_name is not None:
            return deps - {step}
        step_dirs = step_directories(self.directory) if step_dirs is None else step_dirs
        if step in step_dirs:
            names = None if self.item_name is None else [self.item_name]
            deps |= dependencies_from_disk(step_dirs[step], names)
        deps.discard(step)
        return deps

    def dependency(
        self, step: int, step_dirs: Mapping[int, str] | None = None
    ) -> int | None:
        """One dependency of ``step`` (backward compatible; see :meth:`dependencies`)."""
        deps = self.dependencies(step, step_dirs)
        return max(deps) if deps else None

    def _uncertain(self, checkpoints: Sequence[Any], step_dirs: Mapping[int, str]) -> bool:
        """Whether a step still in flight may depend on more than the handlers recorded.

        The handlers record the dependencies of every item they save. While a step is in
        flight and they know fewer of its lossy items than the last committed step has (an
        item saved by a handler this policy was not given), nothing kept by the previous
        decision may be deleted yet.
        """
        in_flight = [c.step for c in checkpoints if c.step not in step_dirs]
        committed = [c.step for c in checkpoints if c.step in step_dirs]
        if not in_flight or not committed:
            return False
        items = 1 if self.item_name else len(lossy_items(step_dirs[max(committed)]))
        uncertain = any(self._memory(step)[0] < items for step in in_flight)
        if uncertain and not self._warned:
            self._warned = True
            warnings.warn(
                f"orbax_lossy: {os.fspath(self.directory)} saves {items} lossy items but the "
                f"{len(self.handlers)} LossyCheckpointHandler(s) given to its "
                "ChainPreservationPolicy saved fewer of them, so steps are kept until they are "
                "on disk. Pass every lossy item's handler to the policy (ol.checkpoint_manager "
                "does this).",
                UserWarning,
                stacklevel=2,
            )
        return uncertain

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> Sequence[bool]:
        """What ``inner`` keeps, plus every step a kept step depends on, directly or not.

        While a step in flight may depend on more than the handlers recorded, every committed
        step the previous decision kept is kept too.
        """
        wanted = list(self.inner.should_preserve(checkpoints, context=context))
        if all(wanted):  # nothing would be deleted: no dependency needs to be read
            self.last_kept_for_chains = {}
            self._last_kept = {c.step for c in checkpoints}
            return wanted
        keep = list(wanted)
        position = {c.step: i for i, c in enumerate(checkpoints)}
        step_dirs = step_directories(self.directory)
        needed_by: dict[int, set[int]] = {}
        for i, checkpoint in enumerate(checkpoints):
            if not wanted[i]:
                continue
            todo, seen = [checkpoint.step], {checkpoint.step}
            while todo:
                for dep in self.dependencies(todo.pop(), step_dirs):
                    if dep in seen or dep not in position:
                        continue
                    seen.add(dep)
                    todo.append(dep)
                    keep[position[dep]] = True
                    if not wanted[position[dep]]:
                        needed_by.setdefault(dep, set()).add(checkpoint.step)
        if self._uncertain(checkpoints, step_dirs):
            for i, checkpoint in enumerate(checkpoints):
                if checkpoint.step in step_dirs and (
                    self._last_kept is None or checkpoint.step in self._last_kept
                ):
                    keep[i] = True
        self.last_kept_for_chains = {s: sorted(v) for s, v in sorted(needed_by.items())}
        self._last_kept = {c.step for c, k in zip(checkpoints, keep, strict=True) if k}
        return keep


# --------------------------------------------------------------------------- legacy options

_DELETE_OPTIONS = ("max_to_keep", "keep_period", "keep_time_interval")


def legacy_delete_options(options: ocp.CheckpointManagerOptions) -> list[str]:
    """The legacy delete options set in ``options`` (Orbax rejects them beside a policy)."""
    return [name for name in _DELETE_OPTIONS if getattr(options, name)]


def legacy_preservation_policy(options: ocp.CheckpointManagerOptions) -> Any:
    """The preservation policy Orbax builds from legacy options, built the same way.

    Mirrors ``orbax.checkpoint.checkpoint_manager._get_default_preservation_policy``: any of
    ``EveryNSteps(keep_period)``, ``EveryNSeconds(keep_time_interval)``, then
    ``BestN(best_fn, reverse=best_mode == "min", n=max_to_keep,
    keep_checkpoints_without_metrics)`` when ``best_fn`` is set, else ``LatestN(max_to_keep)``.
    """
    policies: list[Any] = []
    if options.keep_period is not None:
        policies.append(_P.EveryNSteps(options.keep_period))
    if options.keep_time_interval is not None:
        seconds = int(options.keep_time_interval.total_seconds())
        policies.append(_P.EveryNSeconds(interval_secs=seconds))
    if options.best_fn is not None:
        policies.append(
            _P.BestN(
                get_metric_fn=options.best_fn,
                reverse=(options.best_mode == "min"),
                n=options.max_to_keep,
                keep_checkpoints_without_metrics=options.keep_checkpoints_without_metrics,
            )
        )
    else:
        policies.append(_P.LatestN(n=options.max_to_keep))
    return _P.AnyPreservationPolicy(policies)


# --------------------------------------------------------------------------- reports


def _directory_of(mngr_or_root: Any) -> epath.Path:
    if isinstance(mngr_or_root, (str, os.PathLike)):
        return epath.Path(mngr_or_root)
    return epath.Path(mngr_or_root.directory)


def chain_dependencies(mngr_or_root: Any) -> dict[int, list[int]]:
    """Every step on disk -> the steps it needs to restore (transitively; [] for a base).

    Accepts a ``CheckpointManager`` (its listed steps, after waiting for a save in flight) or
    a root directory (every committed step directory, read from the manifests).
    """
    if not isinstance(mngr_or_root, (str, os.PathLike)):
        mngr_or_root.wait_until_finished()
    step_dirs = step_directories(_directory_of(mngr_or_root))
    direct = {step: dependencies_from_disk(path) for step, path in step_dirs.items()}
    out: dict[int, list[int]] = {}
    for step in sorted(direct):
        todo, seen = list(direct[step]), set()
        while todo:
            dep = todo.pop()
            if dep in seen or dep == step:
                continue
            seen.add(dep)
            todo.extend(direct.get(dep, ()))
        out[step] = sorted(seen)
    return out


def kept_for_chains(mngr: Any) -> dict[int, list[int]]:
    """Steps the manager keeps only because kept steps depend on them.

    Returns ``{step: [the steps its retention policy keeps that need it]}``; steps the
    manager's own policy (the inner policy of its :class:`ChainPreservationPolicy`) keeps
    anyway are not listed. Empty when the manager does not use a chain policy.
    """
    mngr.wait_until_finished()
    policy = getattr(mngr, "_preservation_policy", None)
    if not isinstance(policy, ChainPreservationPolicy):
        return {}
    checkpoints = list(getattr(mngr, "_checkpoints", []))
    if not checkpoints:
        return {}
    policy.should_preserve(checkpoints, context=_P.PreservationContext())
    return dict(policy.last_kept_for_chains)
