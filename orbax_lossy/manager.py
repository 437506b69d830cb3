"""``checkpoint_manager``: a plain, fully configured ``ocp.CheckpointManager``."""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from orbax_lossy.chain import ChainPreservationPolicy
from orbax_lossy.handler import LossyCheckpointHandler, LossyRestore, LossySave
from orbax_lossy.policy import Policy


def checkpoint_manager(
    directory: str | os.PathLike,
    *,
    handler: LossyCheckpointHandler | None = None,
    policy: Policy | None = None,
    base_interval: int = 10,
    max_to_keep: int | None = 3,
    preservation_policy: Any = None,
    save_interval_steps: int = 1,
    enable_async_checkpointing: bool = True,
    options: ocp.CheckpointManagerOptions | None = None,
    **handler_kwargs: Any,
) -> ocp.CheckpointManager:
    """A ``CheckpointManager`` that saves ``LossySave`` items with delta chains kept whole.

    Use it exactly like any manager: ``mngr.save(step, args=LossySave(state))`` and
    ``mngr.restore(step)``. Retention is ``preservation_policy`` (default
    ``LatestN(max_to_keep)``) wrapped in :class:`ChainPreservationPolicy`, so deleting old
    steps never breaks a kept delta's chain. ``options`` may carry any other manager option;
    its ``preservation_policy`` is wrapped the same way.
    """
    if handler is None:
        handler = LossyCheckpointHandler(
            policy, base_interval=base_interval, **handler_kwargs
        )
    elif policy is not None or handler_kwargs:
        raise TypeError("pass either a handler or its settings, not both")
    directory = os.fspath(directory)
    if options is None:
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=enable_async_checkpointing,
        )
    inner = preservation_policy or options.preservation_policy
    if inner is None:
        inner = ocp.checkpoint_managers.LatestN(max_to_keep)  # n=None keeps every step
    options.preservation_policy = ChainPreservationPolicy(inner, handler, directory, "default")
    options.max_to_keep = None
    # Register both args types explicitly (not create_default_handler_registry, which looks
    # the args up by the handler's exact class and so rejects subclasses of the handler).
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("default", LossySave, handler)
    registry.add("default", LossyRestore, handler)
    return ocp.CheckpointManager(directory, options=options, handler_registry=registry)
