"""ckpt_graph: graph-based activation checkpointing for PyTorch."""

from torch.utils.checkpoint import CheckpointPolicy

from ._errors import CkptGraphError
from .region import Region, checkpoint, save_recompute_policy, tag_with_policy

__all__ = [
    "CheckpointPolicy",
    "CkptGraphError",
    "Region",
    "checkpoint",
    "save_recompute_policy",
    "tag_with_policy",
]
__version__ = "0.1.0"
