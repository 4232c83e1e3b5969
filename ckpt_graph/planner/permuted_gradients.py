"""Gradient copies a permute makes a reshape's or a convolution's backward take.

The region-to-simulator adapter (:mod:`ckpt_graph.planner.from_region`) adds them to the
steps of the pass graph: See Note [Permuted gradients].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckpt_graph.planner.sim_graph import SimOp, SimValue

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["permuted_gradient_copies"]


# Note [Permuted gradients]
# A permute's backward permutes its output's gradient back: a view with the layout of the
# output's gradient, not necessarily its input's. A gradient's layout is taken from the
# formula that makes it: dense ops (a linear layer, a layer norm, a convolution) make their
# inputs' gradients contiguous, elementwise ones hand on their output's; a value's own
# layout comes from the strides the region recorded, or else from its producer (a permute
# permutes its input's, a reshape and a dense op are contiguous, a convolution follows a
# channels-last input, an elementwise op its inputs when they agree). Where the two differ
# and the formula needs a dense gradient, it copies: the backward of ``view`` /
# ``_unsafe_view`` (a reshape) makes its input's gradient a copy, a new buffer alive until
# the input's producer's step has run, and a convolution's formula copies its output's
# gradient for its own step (measured; matrix products read transposed gradients as they
# are, and other formulas are not modelled). Batch norm's formula makes its input's
# gradient in the input's suggested memory format (channels last for a channels-last
# input, whatever the layout of its output's gradient), so a channels-last convolution
# read by a batch norm gets its output's gradient in its own layout and copies nothing
# (taken for contiguous, the copy put a channels-last ConvNeXt-style block 131,072 bytes,
# 3.6%, above its measured peak at the depthwise convolution's step). A channels-last block (ConvNeXt: a depthwise convolution, a
# permute to channels last for the norm and the MLP, a permute back before the residual
# add) meets both when its convolutions run channels-first: unmodelled, the prediction of
# a plain-PyTorch ConvNeXt-style region was 8 KiB (2.4-5.3%) below its measured peak, at
# the MLP's last linear layer or at the depthwise convolution's backward; transformers'
# ConvNeXt runs its convolutions channels last and copies neither. Only single-reader
# values are followed (several readers sum their contributions into one dense buffer).
_PERMUTES = frozenset({"aten.permute.default", "aten.transpose.int", "aten.t.default"})
_RESHAPES = frozenset({"aten.view.default", "aten._unsafe_view.default"})
# Batch norm's formulas make the input's gradient in the input's suggested memory format:
# channels last for a channels-last input, else contiguous (measured on CPU).
_BATCH_NORMS = frozenset(
    {
        "aten.native_batch_norm.default",
        "aten._native_batch_norm_legit.default",
        "aten._native_batch_norm_legit.no_stats",
        "aten._native_batch_norm_legit_no_training.default",
    }
)
Strides = tuple[int, ...]


def _dense(shape: Sequence[int]) -> Strides:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _is_dense(shape: Sequence[int], stride: Strides) -> bool:
    return all(n == 1 or a == b for n, a, b in zip(shape, stride, _dense(shape), strict=True))


def _channels_last(shape: Sequence[int]) -> Strides:
    _, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _permutation(region: Region, j: int, rank: int) -> list[int] | None:
    """The output dims of permute-like op node ``j`` as input dims, or ``None``."""
    node = region.nodes[j]
    if node.info.name == "aten.permute.default":
        dims = node.args[1] if len(node.args) > 1 else None
        if isinstance(dims, (list, tuple)) and len(dims) == rank:
            return [int(d) % rank for d in dims]
        return None
    if node.info.name == "aten.t.default":
        return list(range(rank))[::-1]
    if len(node.args) > 2 and isinstance(node.args[1], int) and isinstance(node.args[2], int):
        perm = list(range(rank))
        a, b = node.args[1] % rank, node.args[2] % rank
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    return None


def _layouts(
    region: Region, values: Sequence[SimValue], ops: Sequence[SimOp]
) -> tuple[list[tuple[int, ...]], list[Strides]]:
    """Each value's shape and strides: recorded, else derived (Note [Permuted gradients])."""
    handles = list(region.inputs) + [o for n in region.nodes for o in n.outputs if o is not None]
    assert len(handles) == len(values)
    shapes = [tuple(h.shape) for h in handles]
    known: list[Strides | None] = [
        tuple(h.stride) if h.stride is not None and len(h.stride) == len(h.shape) else None
        for h in handles
    ]
    for j, op in enumerate(ops):  # a permute's recorded output tells its input's layout
        if op.name in _PERMUTES and len(op.outputs) == 1 and op.inputs:
            o, i = op.outputs[0], op.inputs[0]
            perm = _permutation(region, j, len(shapes[o]))
            ko = known[o]
            if known[i] is None and ko is not None and perm is not None:
                known[i] = _unpermute(ko, perm)
    layout = [known[v] or _dense(shapes[v]) for v in range(len(values))]
    for j, op in enumerate(ops):
        ins = [i for i in op.inputs if len(shapes[i]) > 0]
        for o in op.outputs:
            if known[o] is not None:
                continue
            shape = shapes[o]
            if op.name in _PERMUTES and op.inputs:
                perm = _permutation(region, j, len(shape))
                src = layout[op.inputs[0]]
                if perm is not None and len(src) == len(perm):
                    layout[o] = tuple(src[d] for d in perm)
            elif op.name == "aten.convolution.default" and ins and len(shape) == 4:
                first = ins[0]
                if len(shapes[first]) == 4 and not _is_dense(shapes[first], layout[first]):
                    layout[o] = _channels_last(shape)
            elif op.pointwise and ins:
                same = {layout[i] for i in ins if shapes[i] == shape}
                if len(same) == 1:
                    layout[o] = same.pop()
    return shapes, layout


def _unpermute(stride: Strides, perm: Sequence[int]) -> Strides:
    """The strides of a permute's input, from its output's and its dims."""
    out = [0] * len(perm)
    for d, src in enumerate(perm):
        out[src] = stride[d]
    return tuple(out)


def _same_layout(shape: Sequence[int], a: Strides, b: Strides) -> bool:
    return all(n == 1 or x == y for n, x, y in zip(shape, a, b, strict=True))


def permuted_gradient_copies(
    region: Region, values: Sequence[SimValue], ops: Sequence[SimOp], floating: Sequence[bool]
) -> dict[int, tuple[int, int]]:
    """Per step, gradient copies alive at its formula and those its formula makes (bytes).

    See Note [Permuted gradients].
    """
    readers = [0] * len(values)
    for op in ops:
        for i in op.inputs:
            readers[i] += 1
    shapes, layout = _layouts(region, values, ops)
    grad = list(layout)  # each value's gradient's strides, as its single reader makes them
    out: dict[int, tuple[int, int]] = {}

    def add(k: int, alive: int, made: int) -> None:
        a, m = out.get(k, (0, 0))
        out[k] = (a + alive, m + made)

    for j in range(len(ops) - 1, -1, -1):
        op = ops[j]
        if not op.inputs or not op.outputs:
            continue
        o, first = op.outputs[0], op.inputs[0]
        if op.name in _PERMUTES:
            perm = _permutation(region, j, len(shapes[o]))
            if readers[first] == 1 and perm is not None and len(grad[o]) == len(perm):
                grad[first] = _unpermute(grad[o], perm)
        elif op.name in _RESHAPES:
            p = values[first].producer
            if not _is_dense(shapes[o], grad[o]) and p >= 0 and floating[values[first].storage]:
                for k in range(p, j + 1):  # the input's gradient is a copy until it is read
                    add(k, values[o].nbytes, values[o].nbytes if k == j else 0)
        elif op.pointwise:
            for v in op.inputs:
                if readers[v] == 1 and shapes[v] == shapes[o]:
                    grad[v] = grad[o]
        else:
            conv = op.name == "aten.convolution.default"
            single = len(op.outputs) == 1 and values[o].storage == o
            if conv and single and not _same_layout(shapes[o], grad[o], layout[o]):
                add(j, values[o].nbytes, values[o].nbytes)  # its formula copies the gradient
            for v in op.inputs:
                if readers[v] == 1:
                    grad[v] = layout[v] if conv else _dense(shapes[v])
            if (
                op.name in _BATCH_NORMS
                and readers[first] == 1
                and len(shapes[first]) == 4
                and layout[first] == _channels_last(shapes[first])
            ):
                grad[first] = layout[first]  # its formula keeps the input's channels last
    return out
