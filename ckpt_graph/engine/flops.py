"""FLOPs of an op from ``torch.utils.flop_counter``'s formulas: the one estimator behind
``ctx.flops`` (engine), the planner's recompute costs and the analysis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ckpt_graph.engine.graph import Handle

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode

__all__ = [
    "FLOPS_MEMO",
    "FLOPS_MEMO_SIZE",
    "SDPA_NO_FORMULA",
    "estimate_flops",
    "has_flop_formula",
    "node_flops",
]


_aten = torch.ops.aten
# Attention kernels without a registered formula (the CPU flash-attention overloads): they
# cost what the registered SDPA kernels cost (``sdpa_flop_count`` on q, k, v shapes).
SDPA_NO_FORMULA = frozenset(
    {
        _aten._scaled_dot_product_flash_attention_for_cpu,
        _aten._scaled_dot_product_fused_attention_overrideable,
    }
)


def has_flop_formula(op: Any) -> bool:
    """Whether ``estimate_flops`` has a formula for ``op`` (else it returns 0)."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(op, "overloadpacket", None)
    return packet in SDPA_NO_FORMULA or packet in flop_registry


def estimate_flops(op: Any, out: Any, args: Any, kwargs: Any) -> int:
    """FLOPs of one call from ``torch.utils.flop_counter``'s formulas (0 if none).

    See Note [Memoized FLOP formulas].
    """
    from torch.utils.flop_counter import flop_registry, sdpa_flop_count

    packet = getattr(op, "overloadpacket", None)
    sdpa = packet in SDPA_NO_FORMULA
    formula = None if sdpa else flop_registry.get(packet)
    if formula is None and not sdpa:
        return 0
    try:
        key = (op, _shape_key(args), _shape_key(kwargs), _shape_key(out))
        hash(key)
    except TypeError:  # an unhashable argument: compute without the memo
        key = None
    if key is not None and (hit := FLOPS_MEMO.get(key)) is not None:
        return hit
    try:
        if sdpa:
            flops = int(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
        else:
            assert formula is not None
            flops = int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not understand this overload: unknown cost
        flops = 0
    if key is not None:
        if len(FLOPS_MEMO) >= FLOPS_MEMO_SIZE:
            FLOPS_MEMO.clear()
        FLOPS_MEMO[key] = flops
    return flops


# Note [Memoized FLOP formulas]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.utils.flop_counter``'s formulas read only shapes and non-tensor arguments, but each
# call walks its arguments with pytree, which costs more than the formula itself and would
# make ``ctx.flops`` the largest cost of a step under ``memory_budget`` (it reads the FLOPs of
# every op, planned or not). A step repeats the same (op, shapes) calls, so the result is memoized
# on the op overload, each tensor's shape and dtype, and the other arguments as they are.
# Unhashable arguments skip the memo. The memo is bounded: it is cleared when full, so
# variable shapes cannot grow it without limit.
FLOPS_MEMO: dict[tuple[Any, ...], int] = {}
FLOPS_MEMO_SIZE = 4096


def _shape_key(x: Any) -> Any:
    """``x`` with each tensor replaced by its shape and dtype (lists become tuples)."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, (tuple, list)):
        return tuple(_shape_key(i) for i in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _shape_key(v)) for k, v in x.items()))
    return x


def node_flops(node: OpNode) -> int:
    """Estimated FLOPs of one run of a recorded op node (0 if unknown); cached in
    ``node.flops``.

    The formulas read shapes only, so the node's handles are replaced by shape-only (meta)
    stand-ins: no memory is used and no kernel runs. Meta tensors rather than bare shapes,
    because a few formulas (the attention kernels registered with ``get_raw``) read tensor
    attributes. Safe to call while a dispatch mode (a recording region) is active: the
    stand-ins are made with the modes disabled.

    Example:
        >>> node_flops(region.nodes[0])  # doctest: +SKIP
        4096
    """
    if node.flops >= 0:
        return node.flops
    flops = 0
    if has_flop_formula(node.op):
        with _disable_current_modes():
            try:
                args = [_meta(a) for a in node.args]
                kwargs = {k: _meta(v) for k, v in node.kwargs.items()}
                outs = [_meta(o) for o in node.outputs]
            except (RuntimeError, TypeError):  # symbolic or unusual sizes: unknown cost
                outs = None
            if outs is not None:
                out = tuple(outs) if node.out_is_tuple else outs[0]
                flops = estimate_flops(node.op, out, args, kwargs)
    node.flops = flops
    return flops


def _meta(a: Any) -> Any:
    """``a`` with each handle replaced by a meta tensor of its shape and dtype."""
    if type(a) is Handle:
        return torch.empty(a.shape, dtype=a.dtype, device="meta")
    if type(a) is list or type(a) is tuple:
        return [_meta(e) for e in a]
    return a
