"""Parameters' gradient buffers that backward makes: what a ``.grad`` of ``None`` costs.

# Note [Parameters' gradients in backward]
# Rule 10 of Note [Backward liveness model]. A parameter is a region input that is a leaf
# requiring a gradient (its forward tensor has no ``grad_fn``).
# 1. When its ``.grad`` is ``None`` as the region's graph is built, autograd's
#    ``AccumulateGrad`` makes the first gradient it receives the parameter's ``.grad``, and
#    that buffer lives to the end of the training step (the optimizer reads it). It is made
#    when the parameter's gradient is complete: at the step of the first op, in forward
#    order, that reads it (directly or through view ops) and has an output with a gradient
#    (Note [Values without gradients]); ``AccumulateGrad`` runs as soon as it is ready (its
#    sequence number is the highest), so no later step runs first. From there it counts at
#    every step of the region's backward, and after it: ``SimGraph.param_grad_bytes``, which
#    the step budget adds while earlier regions run their backward (Note [Step budget across
#    regions] rule 1).
# 2. Kept or copied. ``AccumulateGrad`` keeps the incoming gradient itself when nothing else
#    references it and its strides are the parameter's, else it copies it. A gradient that
#    reached the parameter through ``t``, ``transpose`` or ``permute`` is a transposed view
#    and is copied, unless the reader's formula gives its transposed operand a gradient in
#    the operand's own layout, which transposed back has the parameter's strides. Whether
#    it does is measured with the op's workspace (``Workspace.own_layout``, Note [Measuring
#    op workspaces] rule 1: ``mm``, ``addmm`` and ``_grouped_mm`` do, ``bmm`` and
#    ``baddbmm`` do not); unmeasured, ``mm`` and ``addmm`` are taken to. (``linear``'s
#    weight reaches ``addmm`` through ``t``: counting a copy put the MLP 16% above its
#    measured peak. Mixtral's experts' weights reach ``_grouped_mm`` through
#    ``transpose``: when only ``mm`` and ``addmm`` were known, the zoo's Mixtral was
#    predicted 0.5-2.6 MB above its measured backward peak at every budget, one weight's
#    copy at each expert projection's step.) A gradient an op hands on to several inputs
#    (``add``, a ``passthrough`` op of ``step_grads``) is shared, and copied. At that step
#    the contribution and the copy are both alive. A sum of contributions from several
#    steps (a tied weight, rule 4) is a buffer of its own and is kept: one buffer, from the
#    last reader's step to the end.
# 3. When ``.grad`` exists, the contributions are added to it in place (rule 4): the buffer
#    is memory held before the step, outside the region's model, as before.
# 4. A parameter with ``requires_grad=False`` has no gradient (rule 4); one the region does
#    not read is not a region input; one read only by ops whose outputs get no gradient
#    (``zeros_like(w)``, ``w.detach()``) gets none from this region.
# 5. Budgets. A byte budget is a promise about the measured step (Note [Measured budget
#    check]), which holds these buffers: its graphs count them. A fraction budget is of the
#    step's simulated peak without checkpointing, as before this rule (Note [Memory budget
#    policy] rule 1): its graphs leave them out (``without_param_grads``), so that a
#    fraction is of what checkpointing changes. (Counting them there too made 0.5 out of
#    reach on the test suite's tiny GPTs, whose parameters' gradients are about half
#    their step peak.) A fraction measured (``check=True``) is of the measured step: its
#    graphs count them (Note [Measured budget check] rule 4).
# Known limitations: the state of ``.grad`` is read when the graph is built (at the region's
# exit): a program that sets gradients to ``None`` between forward and backward is modelled
# with the state before; a planner graph reused by later steps keeps the first step's state
# (with ``zero_grad(set_to_none=False)`` the later steps' gradients exist, and the prediction
# is above their peak by these buffers). A parameter read by several regions of one step gets
# its buffer in the last region whose backward runs; the others add to it in place, but each
# region's graph counts it. A region input that is a view of a parameter made outside the
# region (``w.t()`` passed in) hands its gradient to the parameter after the region's
# backward: its buffer counts in ``param_grad_bytes`` only.
# The measured layout is one answer per op (every input's gradient has its input's strides,
# or not): a parameter read through a transpose by an op that gives another of its inputs a
# gradient of other strides (``mm`` of a strided slice) is taken to be copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from ckpt_graph.planner.sim_graph import SimGraph, SimOp, SimValue

__all__ = ["TRANSPOSING_VIEW_OPS", "param_grads", "without_param_grads"]

# View ops whose gradient formula returns a transposed view of their output's gradient: a
# parameter's first gradient reached through one has other strides than the parameter, and
# ``AccumulateGrad`` copies it (Note [Parameters' gradients in backward] rule 2).
TRANSPOSING_VIEW_OPS = frozenset({"t", "transpose", "permute"})
# Ops whose formula gives a transposed operand its gradient in the operand's own layout
# (``mm_mat2_backward``): no copy (rule 2), where the op's layout was not measured.
_LAYOUT_KEEPING_OPS = frozenset({"mm", "addmm"})


def _packet(name: str) -> str:
    return name.removeprefix("aten.").split(".")[0]


def param_grads(
    values: Sequence[SimValue],
    ops: Sequence[SimOp],
    floating: Sequence[bool],
    store: Sequence[int],
    fresh: Collection[int],
    passthrough: Collection[int] = (),
    own_layout: Mapping[int, bool] | None = None,
) -> tuple[dict[int, int], dict[int, int], int]:
    """The buffers backward makes for parameters whose ``.grad`` is ``None``.

    See Note [Parameters' gradients in backward].

    Args:
        values, ops: the region's simulator graph.
        floating: per value, whether autograd gives it a gradient (``from_region``'s).
        store: per value, the value naming the buffer its gradient is summed in
            (``from_region``'s gradient storage: the root of a view chain).
        fresh: region inputs (value ids) that are parameters with ``.grad`` ``None``.
        passthrough: ops that hand their output's gradient on to their inputs as is.
        own_layout: per measured op, whether its formula gives each input its gradient in
            the input's strides (``Workspace.own_layout``); an op missing here keeps the
            layout if it is ``mm`` or ``addmm``.

    Returns:
        Bytes alive per step (added to the region's gradient bytes), bytes made per step
        (a copy, rule 2), and bytes alive after the region's backward.

    Example:
        >>> w, x = SimValue(64, -1, 0), SimValue(8, -1, 1)
        >>> y, z = SimValue(8, 0, 2), SimValue(8, 1, 3)
        >>> ops = [SimOp((1, 0), (2,), 1, "aten.mm.default"), SimOp((2,), (3,), 1, "tanh")]
        >>> param_grads([w, x, y, z], ops, [True, False, True, True], [0, 1, 2, 3], [0])
        ({}, {}, 64)
    """
    n = len(ops)
    alive: dict[int, int] = {}
    made: dict[int, int] = {}
    end = 0
    wanted = {r for r in fresh if floating[r] and values[r].producer < 0}
    if not wanted:
        return alive, made, end
    # a value has a gradient when its buffer does: a view shares its base's, the output
    # of a view op that allocates its input's gradient (``slice``) has its own
    own = [f or (store[v] == v and floating[values[v].storage]) for v, f in enumerate(floating)]
    has_grad = [own[v] or own[store[v]] for v in range(len(values))]
    skip = set(passthrough)
    first: dict[int, int] = {}  # parameter -> first step (forward order) adding to it
    parts: dict[int, list[tuple[int, int]]] = {}
    for j in range(n - 1, -1, -1):
        op = ops[j]
        if op.outputs and all(store[o] != o for o in op.outputs):
            continue  # a view op: the gradient is formed where the view is consumed
        if not any(has_grad[o] for o in op.outputs):
            continue  # no output with a gradient: nothing flows back (rule 4)
        for i in op.inputs:
            r = store[i]
            if r in wanted:
                first[r] = j
                parts.setdefault(r, []).append((j, i))
    for r, j0 in first.items():
        size = values[r].nbytes
        end += size
        for k in range(j0):
            alive[k] = alive.get(k, 0) + size
        (j, i), *more = parts[r]
        measured = own_layout.get(j) if own_layout is not None else None
        layout_kept = _packet(ops[j].name) in _LAYOUT_KEEPING_OPS if measured is None else measured
        if not more and (j in skip or (not layout_kept and _transposed(values, ops, store, i))):
            alive[j] = alive.get(j, 0) + size  # copied (rule 2)
            made[j] = made.get(j, 0) + size
    return alive, made, end


def _transposed(
    values: Sequence[SimValue], ops: Sequence[SimOp], store: Sequence[int], i: int
) -> bool:
    """Whether ``i`` is made from its buffer ``store[i]`` by view ops one of which transposes."""
    root = store[i]
    v = i
    turned = False
    while v != root:
        producer = values[v].producer
        if producer < 0 or not ops[producer].inputs:
            return False
        turned = turned or _packet(ops[producer].name) in TRANSPOSING_VIEW_OPS
        v = ops[producer].inputs[0]
    return turned


def without_param_grads(g: SimGraph) -> SimGraph:
    """``g`` without the parameters' gradient buffers (Note [Parameters' gradients in
    backward] rule 5: what a fraction budget plans with).

    Example:
        >>> g = SimGraph((SimValue(8, -1, 0),), (), (), param_grad_bytes=8)
        >>> without_param_grads(g).param_grad_bytes
        0
    """
    if not (g.param_grad_bytes or g.param_grad_steps):
        return g
    return dataclasses.replace(g, param_grad_bytes=0, param_grad_steps={}, param_grad_made={})
