"""orbax-lossy: lossy, delta-coded Orbax checkpoints for JAX/Flax training.

The public names are imported on first use (PEP 562), so ``import orbax_lossy`` and the
``orbax-lossy`` command line start without importing JAX, Orbax or Flax; ``ol.LC``,
``from orbax_lossy import LossySave`` and subpackages (``ol.format``) work as before. Type
checkers read the imports in the ``TYPE_CHECKING`` block.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from orbax_lossy._version import __version__ as __version__

if TYPE_CHECKING:
    from orbax_lossy.codecs.bitmask import Bitmask
    from orbax_lossy.codecs.cluster import Cluster
    from orbax_lossy.codecs.exact import Exact
    from orbax_lossy.codecs.lc import LC
    from orbax_lossy.codecs.uniform import Uniform
    from orbax_lossy.codecs.zero import Zero
    from orbax_lossy.errors import (
        ChainError,
        ChecksumError,
        CodecError,
        FormatError,
        InvalidArgumentError,
        LossyError,
        MissingStepError,
        RootLockedError,
        TruncatedError,
        UnsupportedVersionError,
    )
    from orbax_lossy.experts import (
        PartialExperts,
        partial_experts_report,
        rules_from_nnx,
        rules_from_shardings,
    )
    from orbax_lossy.export import export_step
    from orbax_lossy.handler import LossyCheckpointHandler, LossyRestore, LossySave
    from orbax_lossy.manager import checkpoint_manager
    from orbax_lossy.policy import AdaptivePolicy, LeafPolicy
    from orbax_lossy.retention import ChainPreservationPolicy, chain_dependencies, kept_for_chains
    from orbax_lossy.stats import checkpoint_stats

# public name -> the module that defines it (keep in step with the TYPE_CHECKING imports;
# tests/test_cli.py checks that both name the same objects)
_LAZY: dict[str, str] = {
    "Bitmask": "orbax_lossy.codecs.bitmask",
    "Cluster": "orbax_lossy.codecs.cluster",
    "Exact": "orbax_lossy.codecs.exact",
    "LC": "orbax_lossy.codecs.lc",
    "Uniform": "orbax_lossy.codecs.uniform",
    "Zero": "orbax_lossy.codecs.zero",
    **dict.fromkeys(
        ("ChainError", "ChecksumError", "CodecError", "FormatError", "InvalidArgumentError",
         "LossyError", "MissingStepError", "RootLockedError", "TruncatedError",
         "UnsupportedVersionError"),
        "orbax_lossy.errors",
    ),
    **dict.fromkeys(
        ("PartialExperts", "partial_experts_report", "rules_from_nnx", "rules_from_shardings"),
        "orbax_lossy.experts",
    ),
    "export_step": "orbax_lossy.export",
    # from handler, not args: importing it registers the args with Orbax
    **dict.fromkeys(("LossyCheckpointHandler", "LossyRestore", "LossySave"),
                    "orbax_lossy.handler"),
    "checkpoint_manager": "orbax_lossy.manager",
    **dict.fromkeys(("AdaptivePolicy", "LeafPolicy"), "orbax_lossy.policy"),
    **dict.fromkeys(("ChainPreservationPolicy", "chain_dependencies", "kept_for_chains"),
                    "orbax_lossy.retention"),
    "checkpoint_stats": "orbax_lossy.stats",
}

# subpackages and modules reachable as attributes (``ol.format.read_manifest``)
_SUBMODULES = frozenset({
    "args", "cli", "codecs", "demo", "engine", "entropy", "errors", "experts", "export",
    "format", "handler", "manager", "policy", "retention", "stats", "treepaths",
})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


__all__ = [
    "AdaptivePolicy",
    "Bitmask",
    "ChainError",
    "ChainPreservationPolicy",
    "ChecksumError",
    "Cluster",
    "CodecError",
    "Exact",
    "FormatError",
    "InvalidArgumentError",
    "LC",
    "LeafPolicy",
    "LossyCheckpointHandler",
    "LossyError",
    "LossyRestore",
    "LossySave",
    "MissingStepError",
    "PartialExperts",
    "RootLockedError",
    "TruncatedError",
    "Uniform",
    "UnsupportedVersionError",
    "Zero",
    "chain_dependencies",
    "checkpoint_manager",
    "checkpoint_stats",
    "export_step",
    "kept_for_chains",
    "partial_experts_report",
    "rules_from_nnx",
    "rules_from_shardings",
]
