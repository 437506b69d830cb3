"""orbax-lossy: lossy, delta-coded Orbax checkpoints for JAX/Flax training."""

from orbax_lossy._version import __version__ as __version__
from orbax_lossy.codecs.bitmask import Bitmask
from orbax_lossy.codecs.cluster import Cluster
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.lc import LC
from orbax_lossy.codecs.step import Step
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
    "Step",
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
