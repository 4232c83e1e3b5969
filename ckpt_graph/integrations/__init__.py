"""Integrations with other libraries; each submodule imports its library lazily.

- ``ckpt_graph.integrations.transformers``: HuggingFace ``PreTrainedModel`` gradient
  checkpointing through ckpt_graph (``enable`` / ``disable``).
"""

from __future__ import annotations

__all__: list[str] = []
