"""ckpt_graph: graph-based activation checkpointing for PyTorch.

Record a region's aten ops as a lazy graph, keep what the policy says, and recompute the
rest on demand in backward, with gradients identical to a run without checkpointing.
"""

from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph import memory, policies
from ckpt_graph._errors import (
    CkptGraphError,
    CkptGraphImportError,
    CkptGraphTypeError,
    CkptGraphValueError,
)
from ckpt_graph.engine.api import checkpoint, save_recompute_policy, tag_with_policy
from ckpt_graph.engine.region import Region
from ckpt_graph.integrations.wrap import unwrap, wrap
from ckpt_graph.memory import MemoryReport, measure

__all__ = [
    "CheckpointPolicy",
    "CkptGraphError",
    "CkptGraphImportError",
    "CkptGraphTypeError",
    "CkptGraphValueError",
    "MemoryReport",
    "Region",
    "checkpoint",
    "measure",
    "memory",
    "policies",
    "save_recompute_policy",
    "tag_with_policy",
    "unwrap",
    "wrap",
]
__version__ = "0.1.0"
