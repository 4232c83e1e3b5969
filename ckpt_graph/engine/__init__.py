"""The engine: record a region's aten ops, pack saved tensors as handles, realize them in backward.

Pipeline, one module per stage: ``graph`` (op nodes, handles), ``op_info`` (schema facts),
``record`` (the dispatch mode), ``mutation`` (in-place writes, views), ``decisions`` (the
policy protocol the engine asks: context, decisions, stack resolution), ``hooks``
(pack/unpack), ``realize`` (recompute, cache, free), ``region`` and ``api`` (the user-facing
context manager); the README's code map lists the rest. The engine imports nothing from
the layers above it (policies, planner, analysis, compare).
"""

from __future__ import annotations

__all__: list[str] = []
