"""The main job: ``python -m ckpt_graph compare``, strategies side by side on embedded models.

``cli`` parses arguments, ``runner`` measures each strategy, ``strategies`` defines them,
``output`` prints tables, JSON and plots, ``zoo`` builds the workloads (the models of
``architectures`` or Hugging Face ones, a batch and a loss).
"""

from __future__ import annotations

__all__: list[str] = []
