"""``checkpoint_manager``: a plain ``ocp.CheckpointManager`` that keeps delta chains whole.

The manager it returns is an ordinary Orbax manager: a handler registry that sends every
``LossySave``/``LossyRestore`` item, whatever its name, to the lossy handler, plus any other
items you register, and a retention policy that means what the Orbax options say *plus* every
step a kept step depends on (:class:`~orbax_lossy.ChainPreservationPolicy`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import threading
from collections.abc import Mapping
from typing import Any, TypeAlias

import orbax.checkpoint as ocp

from orbax_lossy.entropy import warmup
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.format.schema import MANIFEST_NAME
from orbax_lossy.format.steps import is_remote, listdir, step_directories
from orbax_lossy.handler import LossyCheckpointHandler, LossyRestore, LossySave
from orbax_lossy.policy import Policy
from orbax_lossy.retention import (
    ChainPreservationPolicy,
    legacy_delete_options,
    legacy_preservation_policy,
)

_UNSET: Any = object()
DEFAULT_MAX_TO_KEEP = 3

#: what ``items`` may be: handlers by item name, or an Orbax handler registry
Items: TypeAlias = Mapping[str, Any] | ocp.handlers.CheckpointHandlerRegistry


def _handler_instance(name: str, handler: Any) -> Any:
    if inspect.isclass(handler):
        try:
            return handler()
        except TypeError as e:
            raise InvalidArgumentError(
                f"items[{name!r}]: {handler.__name__} needs constructor arguments; pass an "
                "instance"
            ) from e
    return handler


ORBAX_STANDARD_ARGS = (
    ocp.args.StandardSave, ocp.args.StandardRestore, ocp.args.PyTreeSave,
    ocp.args.PyTreeRestore,
)


def handler_registry(
    handler: LossyCheckpointHandler, items: Items | None = None
) -> tuple[ocp.handlers.DefaultCheckpointHandlerRegistry, list[LossyCheckpointHandler]]:
    """A registry with ``handler`` as the fallback for ``LossySave``/``LossyRestore``.

    ``items`` maps item names to handlers (instances or default-constructible classes) and is
    registered for the args types Orbax associates with each handler; a lossy handler in
    ``items`` serves only that item. ``items`` may also be an Orbax handler registry, whose
    entries are copied. Returns the registry and every lossy handler in it.
    """
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    lossy: list[LossyCheckpointHandler] = [handler]
    if items is None:
        pass
    elif hasattr(items, "get_all_entries"):  # a registry (a Protocol: no isinstance)
        for (name, args_type), h in items.get_all_entries().items():
            registry.add(name, args_type, h)
            if isinstance(h, LossyCheckpointHandler) and h not in lossy:
                lossy.append(h)
    else:
        for name, value in items.items():
            h = _handler_instance(name, value)
            if isinstance(h, LossyCheckpointHandler):
                save_cls, restore_cls = LossySave, LossyRestore
                if h not in lossy:
                    lossy.append(h)
            else:
                try:
                    save_cls, restore_cls = ocp.args.get_registered_args_cls(h)
                except ValueError as e:
                    raise InvalidArgumentError(
                        f"items[{name!r}]: {type(h).__name__} has no registered CheckpointArgs; "
                        "pass an ocp.handlers.DefaultCheckpointHandlerRegistry as items instead"
                    ) from e
            registry.add(name, save_cls, h)
            registry.add(name, restore_cls, h)
    # Single-item managers (item "default") and any other item receiving Lossy args.
    for args_type in (LossySave, LossyRestore):
        if not registry.has("default", args_type):
            registry.add("default", args_type, handler)
        if not registry.has(None, args_type):
            registry.add(None, args_type, handler)
    # Orbax habits on the single item: the handler answers StandardSave & co. with an error
    # that names the fix (instead of Orbax's handler mismatch message printing the tree).
    for args_type in ORBAX_STANDARD_ARGS:
        if not registry.has("default", args_type):
            registry.add("default", args_type, handler)
    return registry, lossy


def chain_options(
    options: ocp.CheckpointManagerOptions,
    directory: str | os.PathLike,
    handlers: LossyCheckpointHandler | list[LossyCheckpointHandler],
) -> ocp.CheckpointManagerOptions:
    """A copy of ``options`` whose retention also keeps every step a kept step needs.

    The legacy delete options (``max_to_keep``, ``keep_period``, ``keep_time_interval``,
    ``best_fn``...) become the policy Orbax would build from them, wrapped in a
    :class:`ChainPreservationPolicy`; ``options`` itself is not modified. ``best_fn`` and
    ``best_mode`` stay set, so ``best_step()`` and metrics work as in Orbax.
    """
    legacy = legacy_delete_options(options)
    inner = options.preservation_policy
    if inner is not None and legacy:
        raise InvalidArgumentError(
            f"options set both preservation_policy and {', '.join(legacy)}; Orbax rejects this "
            "('preservation_policy and delete options are mutually exclusive'). Use one: "
            "express the delete options as a policy (e.g. LatestN(n), EveryNSteps(k), "
            "BestN(...), combined with AnyPreservationPolicy) or drop preservation_policy."
        )
    if inner is None:
        inner = legacy_preservation_policy(options)
    policy = ChainPreservationPolicy(inner, handlers, os.fspath(directory))
    return dataclasses.replace(
        options,
        preservation_policy=policy,
        max_to_keep=None,
        keep_period=None,
        keep_time_interval=None,
    )


def object_store_options(
    options: ocp.CheckpointManagerOptions, directory: str | os.PathLike
) -> ocp.CheckpointManagerOptions:
    """``options``, or a copy that commits in place on an object store other than GCS.

    Orbax's default commit for a path that is not ``gs://`` renames ``<step>.orbax-checkpoint-
    tmp``, which fails on ``s3://`` (``docs/object_stores.md``). For such a URI (``s3://``,
    ``az://``...) whose options choose no commit mode (no ``temporary_path_class``, and
    ``atomicity_options`` unset or ``AUTO``), the copy sets ``AtomicityMode.COMMIT_FILE``: write
    in place and mark a finished step with ``commit_success.txt``, as Orbax does on ``gs://``.
    Local and ``gs://`` paths, and an explicit mode, are left to Orbax.
    """
    from orbax.checkpoint import options as ocp_options

    path = os.fspath(directory)
    if not is_remote(path) or path.startswith("gs://"):
        return options
    if options.temporary_path_class is not None:
        return options
    atomicity = options.atomicity_options
    if atomicity is None:
        atomicity = ocp_options.AtomicityOptions(mode=ocp_options.AtomicityMode.COMMIT_FILE)
    elif atomicity.mode == ocp_options.AtomicityMode.AUTO:
        atomicity = dataclasses.replace(atomicity, mode=ocp_options.AtomicityMode.COMMIT_FILE)
    else:
        return options
    return dataclasses.replace(options, atomicity_options=atomicity)


def checkpoint_manager(
    directory: str | os.PathLike,
    *,
    handler: LossyCheckpointHandler | None = None,
    items: Items | None = None,
    options: ocp.CheckpointManagerOptions | None = None,
    policy: Policy | None = None,
    base_interval: int = 10,
    max_to_keep: int | None = _UNSET,
    preservation_policy: Any = None,
    save_interval_steps: int = _UNSET,
    enable_async_checkpointing: bool = _UNSET,
    partial_experts: Any = None,
    **handler_kwargs: Any,
) -> ocp.CheckpointManager:
    """A ``CheckpointManager`` whose delta chains survive its retention.

    Single item: ``mngr.save(step, args=ol.LossySave(state))``, ``mngr.restore(step)``.
    Several items: register the non-lossy ones in ``items`` (``{"config":
    ocp.handlers.JsonCheckpointHandler()}``) and save ``ocp.args.Composite(state=
    ol.LossySave(s), config=ocp.args.JsonSave(c))``; any item receiving ``LossySave`` /
    ``LossyRestore`` goes to ``handler`` (give a lossy item its own handler in ``items``).

    Retention means what ``options`` (or ``preservation_policy``/``max_to_keep``) say in Orbax,
    plus every step a kept step depends on; ``max_to_keep`` defaults to 3 when no ``options``
    and no policy are given. Keyword options override a copy of ``options``; the caller's
    objects are never modified. On ``s3://`` and other non-``gs://`` object stores the copy
    commits with ``AtomicityMode.COMMIT_FILE`` unless ``options`` choose a commit mode
    (:func:`object_store_options`). ``partial_experts`` (an :class:`~orbax_lossy.PartialExperts`)
    makes the lossy handler store all non-expert state and K experts per MoE layer per save.
    """
    if handler is None:
        handler = LossyCheckpointHandler(policy, base_interval=base_interval, **handler_kwargs)
    elif policy is not None or handler_kwargs:
        raise TypeError("pass either a handler or its settings, not both")
    if partial_experts is not None:  # partial experts checkpoint (orbax_lossy.experts)
        handler.partial_experts = partial_experts
    directory = os.fspath(directory)
    if options is None:
        options = ocp.CheckpointManagerOptions()
        if max_to_keep is _UNSET and preservation_policy is None:
            max_to_keep = DEFAULT_MAX_TO_KEEP
    overrides: dict[str, Any] = {}
    if max_to_keep is not _UNSET:
        overrides["max_to_keep"] = max_to_keep
    if save_interval_steps is not _UNSET:
        overrides["save_interval_steps"] = save_interval_steps
    if enable_async_checkpointing is not _UNSET:
        overrides["enable_async_checkpointing"] = enable_async_checkpointing
    if preservation_policy is not None:
        overrides["preservation_policy"] = preservation_policy
    options = dataclasses.replace(options, **overrides) if overrides else options
    registry, lossy = handler_registry(handler, items)
    options = chain_options(options, directory, lossy)
    options = object_store_options(options, directory)
    manager = ocp.CheckpointManager(directory, options=options, handler_registry=registry)
    compile_latest_ahead(directory)
    return manager


def _compile_latest(directory: str) -> None:
    from orbax_lossy.engine import restore

    steps = step_directories(directory)
    if not steps:
        return
    step_dir = steps[max(steps)]
    for name in sorted(listdir(step_dir)):
        item_dir = os.path.join(step_dir, name)
        if os.path.isfile(os.path.join(item_dir, MANIFEST_NAME)):
            with contextlib.suppress(Exception):  # the restore itself reports a bad chain
                restore.compile_ahead(item_dir)


#: compile_latest_ahead ran in this process (it runs for the first manager only)
_COMPILED_AHEAD = False
_AHEAD_LOCK = threading.Lock()


def _backends_ready() -> bool:
    """Whether JAX's backends exist already (Orbax's manager creates them): compiling must
    never be what initialises them, which ``jax.distributed.initialize`` has to precede."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # another JAX: do not guess
        return False


def compile_latest_ahead(directory: str | os.PathLike) -> None:
    """Start compiling, on a daemon thread, the decode programs a restore of the newest step
    under ``directory`` will need (onto the saved shardings, or the default device): a job
    restarted after a failure creates its manager, builds its state, then restores, and the
    programs compile while the state is built. Once per process, and only before its first
    restore (later managers restore with programs compiled already; the chain walk would only
    compete with their restore: 20-35 ms of a 64 MB one). Local directories only; off with
    ``ORBAX_LOSSY_WARMUP=0`` (as the handler's numba warm-up)."""
    global _COMPILED_AHEAD
    directory = os.fspath(directory)
    if os.environ.get(warmup.ENV, "1") == "0" or is_remote(directory) or not _backends_ready():
        return
    from orbax_lossy.engine import precompile

    with _AHEAD_LOCK:
        if _COMPILED_AHEAD or precompile.submitted():
            return  # not a new process's first restore: its walk would only compete with it
        _COMPILED_AHEAD = True
    threading.Thread(target=_compile_latest, args=(directory,), daemon=True,
                     name="orbax_lossy_compile_ahead").start()
