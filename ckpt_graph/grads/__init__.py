"""Flat gradient buffers: every parameter's ``.grad`` is a view of one contiguous buffer.

See :class:`FlatGrads` (``flat``) and :func:`linear` (``functional``), a linear layer whose
weight gradient is written straight into its slice of the buffer.
"""

from __future__ import annotations

from ckpt_graph.grads.flat import FlatGrads
from ckpt_graph.grads.functional import linear

__all__ = ["FlatGrads", "linear"]
