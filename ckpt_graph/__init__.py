"""ckpt_graph: graph-based activation checkpointing for PyTorch.

Record a region's aten ops as a lazy graph, keep what the policy says, and recompute the
rest on demand in backward, with gradients identical to a run without checkpointing.
"""

import importlib
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

# Note [Foreign warnings in the command]
# ``python -m ckpt_graph`` / ``ckpt-graph`` import this package before their own code runs, and
# with it torch, which warns "Failed to initialize NumPy" in an environment without NumPy (the
# command does not need it). That warning is not ours and says nothing the user must fix, so
# the command's own import of torch ignores it. The check is on ``sys.argv[0]``: ``"-m"`` while
# ``python -m`` imports the package it runs, the script path for the console script. Library
# users importing ckpt_graph still see torch's warnings unchanged.
if getattr(sys, "argv", [""])[:1] == ["-m"] or os.path.basename(sys.argv[0]) == "ckpt-graph":
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
        import torch  # noqa: F401

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
from ckpt_graph.integrations.torch_checkpoint import checkpoint_sequential, patch_torch_checkpoint
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
    "checkpoint_sequential",
    "measure",
    "memory",
    "patch_torch_checkpoint",
    "policies",
    "save_recompute_policy",
    "tag_with_policy",
    "unwrap",
    "wrap",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from ckpt_graph import analysis as analysis
    from ckpt_graph import grads as grads
    from ckpt_graph import integrations as integrations
    from ckpt_graph import nn as nn

# Submodules that import more (networkx, transformers through integrations) load on first
# attribute access: `import ckpt_graph as cg; cg.grads.FlatGrads` works without an import of
# ckpt_graph.grads at `import ckpt_graph`.
_LAZY_SUBMODULES = frozenset({"analysis", "grads", "integrations", "nn"})


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY_SUBMODULES)
