"""ckpt_graph: graph-based activation checkpointing for PyTorch.

Record a region's aten ops as a lazy graph, keep what the policy says, and recompute the
rest on demand in backward, with gradients identical to a run without checkpointing.
"""

from torch.utils.checkpoint import CheckpointPolicy

from . import memory, policies
from ._errors import CkptGraphError, CkptGraphImportError, CkptGraphTypeError, CkptGraphValueError
from .api import checkpoint, save_recompute_policy, tag_with_policy
from .memory import MemoryReport, measure
from .region import Region
from .wrap import unwrap, wrap

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
