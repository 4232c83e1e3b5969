"""Memory-saving modules that compose with ckpt_graph regions."""

from __future__ import annotations

from ckpt_graph.nn.inplace_abn import InPlaceABN, convert_bn_act

__all__ = ["InPlaceABN", "convert_bn_act"]
