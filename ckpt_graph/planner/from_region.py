"""The liveness simulator's graph of a recorded region, and the memory it adds on top.

:func:`from_region` turns a region into a :class:`~ckpt_graph.planner.liveness.SimGraph`: values
and storages, the step of each saved tensor, the ops that may be transient, and two kinds
of memory that do not depend on the plan (Note [Backward liveness model] rules 1, 4 and 7):
gradient buffers per backward step (:func:`grad_bytes`, from the graph alone), and the
*workspaces* of ops, the temporaries an op allocates beyond its results, in its backward
formula (``convolution_backward``'s unfolded input, ``native_batch_norm_backward``'s
normalised input) and when it runs again in backward (``convolution``'s unfolded input).
:func:`~ckpt_graph.planner.workspaces.measure_workspaces` measures them once per op
signature (Note [Measuring op workspaces]).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ckpt_graph.engine import cache_bound, passes
from ckpt_graph.engine.graph import INPLACE_ON_KEPT, KeptReason
from ckpt_graph.engine.op_info import UNANNOTATED_ALIASES
from ckpt_graph.planner.param_grads import param_grads
from ckpt_graph.planner.permuted_gradients import permuted_gradient_copies
from ckpt_graph.planner.records import NO_WORKSPACE, UnmeasuredGraph, Workspace
from ckpt_graph.planner.sim_graph import SimGraph, SimOp, SimValue

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle
    from ckpt_graph.engine.region import Region

__all__ = [
    "from_region",
    "grad_bytes",
    "kept_ops_of",
    "step_grads",
    "unmeasured_graph",
    "with_workspaces",
    "workspace_of",
]

# Note [Unannotated aliases]
# ``_unsafe_view`` (what ``matmul`` and ``linear`` on 3-d inputs return: ``bmm`` / ``mm``
# reshaped), ``unsafe_split`` and ``unsafe_chunk`` return aliases of their first input that
# the engine does not mark as views (each output has a version counter of its own; see
# ``engine.op_info.UNANNOTATED_ALIASES``). Their outputs share the input's storage here, as
# they do in memory, and cost nothing to run again. As candidates with storages of their
# own, keeping a ``bmm`` output and its reshape would count the bytes twice, and recomputing
# the reshape from a kept ``bmm`` would cost as much as a copy.

# Note [Values without gradients]
# Autograd allocates a gradient only for values that require one: a value made from
# inputs that require gradients by an op that is differentiable in that output. A dropout
# mask (``empty_like``, then ``bernoulli_`` and ``div_`` in place) and an additive causal
# mask (``where`` of a boolean mask and constants) get none, though they are floating and
# read by a differentiable op; counting a T x T mask's gradient from its reader's step to
# its producer's put one more T x T tensor in every attention layer's backward (the
# simulator was 14-22% above the measured peak of a GPT-2 with eager attention at 1024
# tokens). Per value, in forward order: the forward tensor's ``requires_grad`` when the
# program still holds it (exact), else whether an input requires one, except for the ops
# of ``_NO_GRAD_OPS``, whose floating outputs never do (factories that read only their
# argument's shape, ``detach``) and the outputs of ``_NO_GRAD_OUTPUTS``. A storage needs a
# gradient when one of its versions does (an in-place op writing a value that requires
# one into a fresh buffer). Not modelled: ops run under ``no_grad`` inside the region
# whose outputs the program no longer holds (counted as needing a gradient).

# Note [Values backward never reaches]
# Autograd runs a node's formula only when the loss's graph reaches it, and
# ``AccumulateGrad`` only for a parameter it reaches: a value that requires a gradient but
# leads to the loss through no differentiable output gets no gradient buffer, and a
# parameter read only through it gets no ``.grad``. An MoE router read only through
# ``argmax``, the indices of ``topk`` or a comparison is one (their outputs are integer or
# boolean; ``topk``'s values output, dropped, is another dead end). Counting them put the
# router's gradient in the step's parameters' gradients and a gradient of the dropped
# values in backward from its start, as if a region output. The loss is not known when the
# graph is built (at the region's exit), so a value the program still holds there counts as
# a region output that may get a gradient; from those, backwards in forward order, an op
# with a reached output reaches its inputs that require a gradient, and a storage is reached
# when one of its versions or views is. A dead end's nodes die in forward with the last
# tensor referring to them, and their saved tensors with them: those saves are left out of
# the graph (``topk``'s indices, kept under ``must_save_all``, measured freed). A graph built
# once a backward pass has begun, or after the program dropped every output of the region
# (analysis, the simulator's tests), cannot tell what the program held at the exit: every
# value requiring a gradient counts as reached there.

# Note [In-place writes to kept values]
# When an op writes in place to a kept value nothing else used (dropout on CPU:
# ``empty_like``, then ``bernoulli_`` and ``div_`` on it), the engine keeps the new version
# (``INPLACE_ON_KEPT``) in the same storage. Whether that happens follows from whether the
# plan keeps the written value, so such a value is fixed only when the op owning its
# storage is not the plan's to decide; otherwise a first step whose heuristic kept a
# dropout's ``empty_like`` would fix its mask for every later plan.


SAVED_AFTER_INPUTS_FREED = KeptReason.SAVED_AFTER_INPUTS_FREED

# Note [Values kept by a step's own frees]
# The engine keeps a value the policy answered to recompute when it is saved after the kept
# values its recomputation reads were freed (``SAVED_AFTER_INPUTS_FREED``): a consequence of
# that step's decisions, not of the program. The first step, decided by the heuristic, can
# do so where a plan does not; fixed in the graph, such a value was planned as kept
# whatever the plan says while the planned steps recompute it. Qwen2-MoE at torch per-block
# checkpointing's peak: a residual ``add`` (256 KiB) kept so at the heuristic's step put the
# plan's prediction 1.5 MiB under the measured step (14,060,536 vs 15,653,512 B; without it
# fixed, 15,653,504). Such an op is the plan's to decide (``free_ops``), its value not fixed.

_NO_GRAD_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "detach",
    )
)
# (op, output index) of floating outputs autograd never differentiates
_NO_GRAD_OUTPUTS = frozenset(
    {
        ("aten.native_layer_norm", 1),
        ("aten.native_layer_norm", 2),
        ("aten.nll_loss_forward", 1),
        ("aten.nll_loss2d_forward", 1),
        ("aten._scaled_dot_product_flash_attention_for_cpu", 1),
    }
)


def grad_bytes(
    values: Sequence[SimValue],
    ops: Sequence[SimOp],
    floating: Sequence[bool],
    passthrough: Collection[int] = (),
) -> dict[int, int]:
    """Gradient bytes alive per step. See Note [Backward liveness model] rule 4.

    ``passthrough`` ops return their output's gradient as their inputs' (``add``): the
    inputs whose gradient starts there share that buffer instead of getting their own.
    """
    return step_grads(values, ops, floating, passthrough)[0]


def step_grads(
    values: Sequence[SimValue],
    ops: Sequence[SimOp],
    floating: Sequence[bool],
    passthrough: Collection[int] = (),
) -> tuple[dict[int, int], dict[int, int]]:
    """Gradient bytes alive per step when its formula runs, and while it unpacks.

    The second figure leaves out the gradients the step itself allocates (those of its
    inputs): autograd unpacks a node's saved tensors, so recomputes them, before its
    formula runs. See Note [Backward liveness model] rule 4.
    """
    n = len(ops)
    store = _gradient_storage(values, ops)
    floating = [
        f or (store[v] == v and floating[values[v].storage]) for v, f in enumerate(floating)
    ]
    last_use = [-1] * len(values)
    for j, op in enumerate(ops):
        for i in op.inputs:
            last_use[store[i]] = j
    low: dict[int, int] = {}  # gradient buffer (named by a value) -> first step it is freed at
    for v, val in enumerate(values):
        if floating[v] and store[v] == v and val.producer >= 0:
            low[v] = val.producer
    buffer = list(range(len(values)))  # the buffer holding each value's gradient
    shared: dict[int, list[tuple[int, int]]] = {}  # buffer -> (step, region input) handed it
    for j in sorted(passthrough, reverse=True):
        outs = [o for o in ops[j].outputs if o in low or buffer[o] != o]
        if len(outs) != 1:
            continue
        b = buffer[outs[0]]
        for i in ops[j].inputs:
            r = store[i]
            # passed on as is (a view of it through ``t`` or ``view`` included)
            as_is = i == r or _view_gradient(values, ops, store, i)
            if as_is and r in low and last_use[r] == j and buffer[r] == r:
                del low[r]
                buffer[r] = b
                low[b] = min(low[b], values[r].producer)
            elif as_is and values[r].producer < 0 and floating[r] and b in low:
                shared.setdefault(b, []).append((j, r))
    # the contributions to each gradient: (step, the value read), last step first
    skip = set(passthrough)
    contributions: dict[int, list[tuple[int, int]]] = {}
    for j in range(n - 1, -1, -1):
        op = ops[j]
        if j in skip or (op.outputs and all(store[o] != o for o in op.outputs)):
            continue  # a view op: the gradient is formed where the view is consumed
        for i in op.inputs:
            root = store[i]
            if floating[root]:
                contributions.setdefault(root, []).append((j, i))
    dense = _summed_broadcasts(values, ops, low, buffer, shared, contributions)
    for b, parts in shared.items():  # a region input's buffer holds the shared one
        below = [k for j, r in parts for k, _ in contributions.get(r, ()) if k < j]
        if below:
            low[b] = min(low[b], *below)
    top = {v: last_use[v] for v in low}  # the step that makes each buffer (-1: none)
    for r, parts in contributions.items():
        steps = {j for j, _ in parts}
        if values[r].producer < 0 and len(steps) > 1:
            # a region input read at several steps: autograd sums the contributions in one
            # buffer from the last step that reads it to the first (rule 4, tied weights)
            low[r], top[r] = min(steps), max(steps)
    delta = [0] * (n + 2)
    made = [0] * n  # gradient bytes each step allocates
    for v, first in low.items():
        end = top[v] if top[v] >= 0 else n - 1
        delta[first] += values[v].nbytes
        delta[end + 1] -= values[v].nbytes
        if top[v] >= 0:  # else a region output's: there before backward starts
            made[end] += values[v].nbytes
    for b, (m, size) in dense.items():
        delta[low[b]] += size
        delta[m] -= size
        # made after the step's formula, whose workspace is freed by then
        extra = max(size - ops[m].workspace, 0)
        delta[m] += extra
        delta[m + 1] -= extra
        made[m] += extra
    out: dict[int, int] = {}
    level = 0
    for j in range(n):
        level += delta[j]
        out[j] = level
    for r, parts in contributions.items():
        view = False  # the buffer is a view of the first contribution's gradient
        for j, i in parts:
            if r in low and j >= top[r]:
                view = view or _view_gradient(values, ops, store, i)
                continue  # the buffer itself, counted above
            # a parameter's gradient, or a contribution added to an existing buffer
            extra = values[i].nbytes if values[i].nbytes else values[r].nbytes
            if view and buffer[r] == r:
                extra += values[r].nbytes  # summed out of place (rule 4)
                view = False
            out[j] += extra
            made[j] += extra
    return out, {j: out[j] - made[j] for j in range(n)}


def _summed_broadcasts(
    values: Sequence[SimValue],
    ops: Sequence[SimOp],
    low: Mapping[int, int],
    buffer: Sequence[int],
    shared: Mapping[int, list[tuple[int, int]]],
    contributions: Mapping[int, list[tuple[int, int]]],
) -> dict[int, tuple[int, int]]:
    """Per shared buffer smaller than a value it is handed to (``sum``'s formula expands
    its output's gradient: no memory), the step where a contribution is first summed into
    it, out of place, and the bytes of that dense sum. See Note [Backward liveness model]
    rule 4."""
    members: dict[int, list[int]] = {}
    for r, b in enumerate(buffer):
        if b != r and b in low:
            members.setdefault(b, []).append(r)
    for b, parts in shared.items():
        members.setdefault(b, []).extend(r for _, r in parts)
    out: dict[int, tuple[int, int]] = {}
    for b, rs in members.items():
        first = max(
            ((j, r) for r in rs for j, _ in contributions.get(r, ())),
            default=None,
        )
        if first is not None and values[first[1]].nbytes > values[b].nbytes:
            out[b] = (first[0], values[first[1]].nbytes)
    return out


# Ops whose gradient formula returns a view of their output's gradient (``t``: its transpose;
# ``view``: a reshape of it), by overload packet name. See Note [Backward liveness model]
# rule 4: a gradient buffer holding such a view cannot take the next contribution in place.
VIEW_GRADIENT_OPS = frozenset(
    {
        "_reshape_alias",
        "_unsafe_view",
        "alias",
        "permute",
        "reshape",
        "squeeze",
        "t",
        "transpose",
        "unsqueeze",
        "view",
        "view_as",
    }
)


# View ops whose formula allocates their input's gradient (``slice`` and ``select`` a zero
# tensor of the input's size, ``split`` and ``unbind`` the concatenation of their outputs'
# gradients, ``expand`` a sum): each output's gradient is a buffer of its own until the op's
# step (Note [Backward liveness model] rule 4).
OWN_GRADIENT_VIEW_OPS = frozenset(
    {
        "as_strided",
        "chunk",
        "diagonal",
        "expand",
        "narrow",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "unbind",
        "unsafe_chunk",
        "unsafe_split",
        "unsafe_split_with_sizes",
    }
)


def _packet(name: str) -> str:
    return name.removeprefix("aten.").split(".")[0]


def _gradient_storage(values: Sequence[SimValue], ops: Sequence[SimOp]) -> list[int]:
    """Per value, the value naming the buffer its gradient is summed in: its storage's,
    except below a view op of ``OWN_GRADIENT_VIEW_OPS``, whose outputs have their own."""
    store = [v.storage for v in values]
    for v, val in enumerate(values):
        if val.storage == v or val.producer < 0:
            continue
        op = ops[val.producer]
        if _packet(op.name) in OWN_GRADIENT_VIEW_OPS:
            store[v] = v
        elif op.inputs and values[op.inputs[0]].storage == val.storage:
            store[v] = store[op.inputs[0]]
    return store


def _view_gradient(
    values: Sequence[SimValue], ops: Sequence[SimOp], store: Sequence[int], i: int
) -> bool:
    """Whether the gradient reaching the buffer ``store[i]`` from a reader of ``i`` is a
    view: ``i`` is made from it by view ops whose formulas all return views."""
    root = store[i]
    v = i
    while v != root:
        producer = values[v].producer
        if producer < 0:
            return False
        op = ops[producer]
        if not op.inputs or _packet(op.name) not in VIEW_GRADIENT_OPS:
            return False
        v = op.inputs[0]
    return i != root


def workspace_of(workspaces: Mapping[int, Workspace] | None, index: int) -> Workspace:
    """The workspace of op ``index`` (zero when not measured)."""
    if workspaces is None:
        return NO_WORKSPACE
    return workspaces.get(index, NO_WORKSPACE)


def kept_ops_of(region: Region) -> frozenset[int]:
    """Indices of the region's op nodes with an output kept by a policy or tag."""
    return frozenset(
        n.index
        for n in region.nodes
        if any(o is not None and o.reason is not None and not o.reason.by_engine for o in n.outputs)
    )


def from_region(
    region: Region,
    costs: Mapping[int, int] | None = None,
    free_ops: Iterable[int] = (),
    workspaces: Mapping[int, Workspace] | None = None,
) -> SimGraph:
    """Build the :class:`SimGraph` of a recorded region.

    ``unmeasured_graph`` then ``with_workspaces``: the budget planner keeps the first and
    adds the workspaces when they are measured (Note [Workspaces in budget planning]).

    Args:
        region: a region whose forward has run (values may be freed; metadata is used).
            Generator states are those the region still holds: a dead random op freed
            its own (see Note [Backward liveness model] rule 9), so build the graph of a
            region before its backward to count them.
        costs: recompute cost per op index; missing ops cost the elements of their outputs;
            ops whose outputs are all views cost 0.
        free_ops: ops whose kept outputs are left to the plan (not fixed); outputs of every
            other op are fixed as the forward decided them.
        workspaces: temporaries per op index, e.g. from
            :func:`~ckpt_graph.planner.workspaces.measure_workspaces`; none when omitted.

    Example:
        >>> g = from_region(region, workspaces=measure_workspaces(region))  # doctest: +SKIP
        >>> simulate(g, kept_ops_of(region)).peak_total_bytes  # doctest: +SKIP
    """
    return with_workspaces(unmeasured_graph(region, costs, free_ops), workspaces)


def unmeasured_graph(
    region: Region, costs: Mapping[int, int] | None = None, free_ops: Iterable[int] = ()
) -> UnmeasuredGraph:
    """What :func:`from_region` reads of ``region``, before the ops' workspaces are known.

    Arguments as for :func:`from_region`; :func:`with_workspaces` finishes the graph. Read
    while the region is as its forward left it (generator states, tensors the program
    holds): the result holds no framework object and can wait.
    """
    free = set(free_ops)
    vid: dict[int, int] = {}
    values: list[SimValue] = []
    fixed: set[int] = set()
    floating: list[bool] = []
    needs: list[bool] = []  # requires a gradient in forward, views included
    held: list[bool] = []  # an op output the program still holds (a region output)
    after_pass = region.pass_state.number > 0  # See Note [Values backward never reaches].
    fresh: list[int] = []  # See Note [Parameters' gradients in backward].
    after: dict[int, int] = {}
    for inp in region.inputs:
        if _fresh_grad(inp, after):
            fresh.append(len(values))
        vid[id(inp)] = len(values)
        # a copy taken before a write of the region: see Note [Backward liveness model] rule 3
        copied = inp.copied and inp.value is not None
        values.append(SimValue(inp.nbytes, -1, len(values), copied=copied))
        floating.append(_requires_grad(inp, inp.dtype.is_floating_point))
        needs.append(floating[-1])
        held.append(False)
    ops: list[SimOp] = []
    used: set[int] = set()  # values consumed so far (ops and saves), for rule 6
    states: dict[int, int] = {}  # id of a generator state -> its index (rule 9)
    rng_bytes: list[int] = []
    saves = sorted(((n, id(h)) for n, h in region.saved), key=lambda e: e[0])
    next_save = 0
    for node in region.nodes:
        while next_save < len(saves) and saves[next_save][0] <= node.index:
            used.add(saves[next_save][1])
            next_save += 1
        ins = tuple(vid[id(i)] for i in node.inputs if id(i) in vid)
        outs: list[int] = []
        info = node.info
        alias = bool(ins) and node.op in UNANNOTATED_ALIASES  # See Note [Unannotated aliases]
        for out in node.outputs:
            if out is None:
                continue
            v = len(values)
            vid[id(out)] = v
            root = v
            if (
                (ins and out.is_view and not info.returns_written)
                or (ins and info.returns_written and id(node.inputs[0]) not in used)
                or alias
            ):
                root = values[ins[0]].storage
            values.append(SimValue(out.nbytes, node.index, root, out.is_view))
            grad = out.dtype.is_floating_point and _differentiable(node.op, out.output_index)
            grad = _requires_grad(out, grad and any(floating[values[i].storage] for i in ins))
            floating.append(grad and root == v)
            needs.append(grad)
            held.append(after_pass or (out.ref is not None and out.ref() is not None))
            if grad and root != v and not out.is_view and values[root].producer >= 0:
                floating[root] = True  # See Note [Values without gradients]
            outs.append(v)
            decided = node.index not in free or (out.reason is not None and out.reason.by_engine)
            if out.reason == INPLACE_ON_KEPT and root != v and values[root].producer in free:
                decided = False  # See Note [In-place writes to kept values]
            if out.reason == SAVED_AFTER_INPUTS_FREED and node.index in free:
                decided = False  # See Note [Values kept by a step's own frees]
            if out.kept and decided:
                fixed.add(v)
        if alias or all(o is None or o.is_view for o in node.outputs):
            cost = 0  # views and aliases compute nothing
        elif costs is not None and node.index in costs:
            cost = costs[node.index]
        else:
            cost = sum(o.shape.numel() for o in node.outputs if o is not None)
        pointwise = (
            info.is_pointwise
            and not info.writes
            and not info.is_random
            and len(node.outputs) == 1
            and len(outs) == 1
        )
        rng = -1
        if node.rng is not None:  # See Note [Backward liveness model] rule 9.
            state = node.rng[1]
            rng = states.setdefault(id(state), len(states))
            if rng == len(rng_bytes):
                rng_bytes.append(state.untyped_storage().nbytes())
        ops.append(SimOp(ins, tuple(outs), cost, info.name, 0, 0, pointwise, rng))
        used.update(id(i) for i in node.inputs)
    if not any(held):  # the outputs were dropped before the graph was built: no loss to reach
        held = needs  # See Note [Values backward never reaches].
    reached, owners = _reached(values, ops, needs, held)
    logs = ((n, vid.get(id(h))) for n, h in region.saved)
    logged = tuple(_live_saves(logs, ops, needs, reached))
    floating = [f and owners[v] for v, f in enumerate(floating)]
    read = {values[i].storage for op in ops for i in op.inputs}
    for _, sv in logged:  # saved but never read (batch norm's save_mean): no gradient
        if sv is not None and sv not in read and values[sv].storage == sv:
            floating[sv] = False
    g = SimGraph(
        tuple(values),
        tuple(ops),
        (),
        frozenset(fixed),
        {},
        passes.TRANSIENT_MIN_BYTES,
        region.cache_limit,
        tuple(rng_bytes),
        {},
        cache_bound.BOUND_MIN_BYTES,
    )
    permuted = permuted_gradient_copies(region, values, ops, floating)
    return UnmeasuredGraph(g, logged, tuple(floating), permuted, tuple(fresh), sum(after.values()))


def with_workspaces(base: UnmeasuredGraph, workspaces: Mapping[int, Workspace] | None) -> SimGraph:
    """The graph of ``base`` with the ops' ``workspaces`` (none when omitted): their
    temporaries, the steps of the saves they tell apart, the gradients they pass on.

    See Note [Workspaces in budget planning] (``region_graph.py``) and Note [Backward
    liveness model] rules 1 and 4.
    """
    g = base.g
    ops = list(g.ops)
    if workspaces:
        for j, ws in workspaces.items():
            ops[j] = replace(ops[j], workspace=ws.backward, run_workspace=ws.recompute)
    saved = _steps_of_saves(base.saves, ops, workspaces)
    ws_items = workspaces.items() if workspaces is not None else ()
    passthrough = [j for j, w in ws_items if w.input_grads == 0]
    grads, grads_in = step_grads(g.values, ops, base.floating, passthrough)
    for k, (alive, made) in base.permuted.items():
        grads[k] = grads.get(k, 0) + alive
        grads_in[k] = grads_in.get(k, 0) + alive - made
    store = _gradient_storage(g.values, ops)
    layouts = {j: w.own_layout for j, w in ws_items if w.own_layout is not None}
    alive_p, made_p, end = param_grads(
        g.values, ops, base.floating, store, base.fresh, passthrough, layouts
    )
    return replace(
        g,
        ops=tuple(ops),
        saved=tuple(saved),
        step_grad_bytes=grads,
        step_grad_in_bytes=grads_in,
        param_grad_bytes=end + base.after_bytes,
        param_grad_steps=alive_p,
        param_grad_made=made_p,
    )


def _reached(
    values: Sequence[SimValue], ops: Sequence[SimOp], needs: Sequence[bool], held: Sequence[bool]
) -> tuple[list[bool], list[bool]]:
    """Per value and per storage owner, whether backward reaches it: a value requiring a
    gradient that the program holds (a region output) or an op reads whose output backward
    reaches; a storage when one of its versions or views is. See Note [Values backward
    never reaches]."""
    reached = [n and h for n, h in zip(needs, held, strict=True)]
    for op in reversed(ops):
        if any(reached[o] for o in op.outputs):
            for i in op.inputs:
                reached[i] = reached[i] or needs[i]
    owners = [False] * len(values)
    for v, r in enumerate(reached):
        if r:
            owners[values[v].storage] = True
    return reached, owners


def _live_saves(
    logged: Iterable[tuple[int, int | None]],
    ops: Sequence[SimOp],
    needs: Sequence[bool],
    reached: Sequence[bool],
) -> Iterable[tuple[int, int | None]]:
    """``logged`` without the saves of ops whose outputs require a gradient that backward
    never reaches: autograd drops their nodes, and the saved tensors, in forward. A save
    logged after ``n`` ops belongs to op ``n - 1`` or ``n`` (``_steps_of_saves``). See Note
    [Values backward never reaches]."""
    dead = [
        any(needs[o] for o in op.outputs) and not any(reached[o] for o in op.outputs) for op in ops
    ]
    for n, sv in logged:
        owners = [
            k
            for k in (n - 1, n)
            if 0 <= k < len(ops)
            and sv is not None
            and (sv in ops[k].inputs or sv in ops[k].outputs)
        ]
        if not (owners and all(dead[k] for k in owners)):
            yield n, sv


def _fresh_grad(h: Handle, after: dict[int, int]) -> bool:
    """Whether the region input ``h`` is a parameter whose ``.grad`` is ``None``; a view of
    such a parameter made outside the region adds the parameter's bytes to ``after`` (by
    storage). See Note [Parameters' gradients in backward]."""
    t = h.ref() if h.ref is not None else None
    if t is None or not t.requires_grad:
        return False
    if not t._is_view():  # a view's grad_fn is not read: see BudgetCheck.note_region
        return t.grad_fn is None and t.grad is None
    base = t._base
    if base is not None and base.requires_grad and base.grad_fn is None and base.grad is None:
        storage = base.untyped_storage()
        after[storage.data_ptr()] = storage.nbytes()
    return False


def _requires_grad(h: Handle, inferred: bool) -> bool:
    """Whether autograd gives the value of ``h`` a gradient: its forward tensor says so
    while the program holds it, else ``inferred``. See Note [Values without gradients]."""
    t = h.ref() if h.ref is not None else None
    if t is None:
        return inferred
    return bool(t.requires_grad) and (t.dtype.is_floating_point or t.dtype.is_complex)


def _differentiable(op: object, output_index: int) -> bool:
    """Whether output ``output_index`` of ``op`` may require a gradient (Note [Values
    without gradients])."""
    name = str(getattr(op, "_overloadpacket", op))
    return name not in _NO_GRAD_OPS and (name, output_index) not in _NO_GRAD_OUTPUTS


def _steps_of_saves(
    logged: Sequence[tuple[int, int | None]],
    ops: Sequence[SimOp],
    workspaces: Mapping[int, Workspace] | None,
) -> list[tuple[int, int]]:
    """``(step, value id)`` per saved tensor of the region, from ``(ops recorded before
    the save, value id)`` as logged. See Note [Backward liveness model] rule 1."""
    n_ops = len(ops)
    times = Counter(logged)
    seen: Counter[tuple[int, int | None]] = Counter()
    taken = [0] * (n_ops + 1)  # output saves already given to each op
    saved: list[tuple[int, int]] = []
    last = 0
    for n, sv in logged:
        if sv is None:
            continue
        seen[n, sv] += 1
        step = n if n < n_ops and sv in ops[n].inputs else n - 1
        if step == n and n > 0 and sv in ops[n - 1].outputs:
            expected = workspace_of(workspaces, n - 1).output_saves
            if expected >= 0:  # measured: op n-1 saves that many of its outputs first
                step = n - 1 if taken[n - 1] < expected else n
            elif times[n, sv] > 1 and seen[n, sv] == 1:
                step = n - 1  # saved as op n-1's output, then again as op n's input
        if step == n - 1 and n > 0:
            taken[n - 1] += 1
        last = max(last, min(max(step, 0), n_ops - 1))
        saved.append((last, sv))
    return saved
