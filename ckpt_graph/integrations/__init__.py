"""Integrations with other libraries; each submodule imports its library lazily.

- ``ckpt_graph.integrations.transformers``: HuggingFace ``PreTrainedModel`` gradient
  checkpointing through ckpt_graph (``enable`` / ``disable``), also on the Trainer's
  ``gradient_checkpointing=True`` path.
- ``ckpt_graph.integrations.lightning``: a PyTorch Lightning ``CheckpointCallback``.

The submodules are attributes loaded on first access (``cg.integrations.transformers``); the
library they integrate is imported only when one of their functions needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_graph.integrations import lightning, transformers

__all__ = ["lightning", "transformers"]

_SUBMODULES = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
