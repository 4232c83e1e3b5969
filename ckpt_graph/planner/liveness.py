"""Liveness simulation of a region's backward: predicted peak memory and recompute cost.

The simulator replays, without running any op, what the engine does in backward for a given
set of kept op outputs: the order in which autograd unpacks saved tensors, the use counts of
``passes.py`` (see Note [Use counts and freeing]), the values cached while they still have a
pending use, transient values (Note [Transient values]), kept values released as autograd
frees saved tensors (Note [Releasing kept values]), the gradient buffers alive at each step
and the temporaries of op formulas. It works on a small framework-free graph
(:class:`SimGraph`) so planners can be tested on synthetic graphs;
``from_region.from_region`` builds one from a recorded region.

# Note [Backward liveness model]
# 1. Unpack order. Saved tensors are grouped into backward *steps*: the op node whose
#    autograd node saved them. Inputs are saved just before the op is recorded, outputs
#    just after, so a save logged after ``n`` recorded ops belongs to op ``n`` if the value
#    is one of its inputs, else to op ``n - 1``. A value made by op ``n - 1`` and read by op
#    ``n`` is ambiguous (``log_softmax`` saves its result, which ``nll_loss`` saves again):
#    op ``n - 1``'s output saves come first, and their number is measured with the
#    workspaces (``Workspace.output_saves``); unmeasured, the first of two such saves in a
#    row goes to op ``n - 1``. Autograd runs its nodes in reverse topological order, which
#    for one region is the reverse forward order (sequence numbers grow with the forward),
#    so steps run from the last op back and a step unpacks all its saved tensors, which
#    stay alive (*held*) until the step ends.
# 2. Realize. Use counts start at the number of saved tensors per recomputed value; one sweep
#    from the last op back marks the ops that will run and adds one use per recomputed input,
#    exactly as ``passes.begin_pass``. A run op allocates all its outputs, caches the ones
#    with a pending use, drops the others at once, then releases one use of each recomputed
#    input; a cached value is freed when its use count reaches zero. Every op runs at most
#    once per pass (except producers of transient values, rule 7), and the recompute cost of
#    a plan is the summed cost of the runs.
# 3. Memory is counted per *storage*: a view shares the storage of its base, so keeping or
#    caching a view keeps the whole base (in-place results: rule 6). Storages of region
#    inputs (parameters, the batch) are never counted: they live anyway.
#    activation memory = storages of live kept values + cached or held recomputed values.
# 4. Gradients and temporaries: total memory = activation memory + gradient buffers + the
#    temporaries of the op running now. The gradient of an op output (floating, not a view)
#    is alive from the step of its last consumer (or from the start for a region output:
#    a value no op reads and autograd does not save, unlike ``native_layer_norm``'s mean
#    and ``native_batch_norm``'s inverse deviation, which get no gradient) to the step of
#    its producer; a region input's gradient is counted at each consumer's step
#    only (parameters accumulate into ``.grad`` at once), and so is the contribution of an
#    earlier consumer to an existing gradient (allocated, then added to the buffer). An op
#    whose formula allocates no input gradient (measured: ``add`` hands its output's
#    gradient on) makes the gradients starting at its step share that one buffer, alive
#    until the last of them is consumed. An op's ``workspace`` (what its backward formula
#    allocates beyond the input gradients: the unfolded input of a slow convolution, the
#    normalised input of batch norm, oneDNN's reordered copies) counts at its step; its
#    ``run_workspace`` (the same for its forward) counts whenever it runs in backward.
#    Autograd unpacks a node's saved tensors before its formula runs, so while a step's
#    values are recomputed the gradients that step allocates do not exist yet
#    (``step_grad_in_bytes``); they do when its formula and workspace run. (Counting them
#    during the recompute too put a convolution's recompute workspace on top of its
#    consumer's input gradients: a CNN plan was predicted 12% above its measured peak.)
#    None depend on the plan: they raise ``peak_total_bytes``, not ``peak_bytes``.
#    Workspaces are measured once per op signature (Note [Measuring op workspaces]); without
#    them (``from_region(region)``) they are 0, which underestimates convolutional models
#    (the measured peak is 1.5-2.2x the prediction on a float64 CNN) but barely matters for
#    matmul models (their formulas allocate little beyond their gradients).
# 5. Kept values are live while a saved tensor may need them, as the engine counts it:
#    live uses = saved tensors + ops that must run for a recomputed value (Note [Releasing
#    kept values]). Kept values without live uses at region exit are not counted. After a
#    step ran, each of its saved tensors takes one live use of its value; a kept value with
#    none left is released; a recomputed value with none left makes its producer dead once
#    all its recomputed outputs are, which takes a use of each of the producer's inputs.
#    (An earlier version did not model this release: it matched a measurement of
#    ``loss.backward`` alone, which ignores frees of blocks allocated before the call, kept
#    values included, and modelling the release then looked 13-27% too low. Measured over
#    forward and backward, the real peak of budget plans was 18-38% below that version.)
# 6. An in-place op returns a new version in the storage of the written value when nothing
#    used the old version before (the engine then keeps one tensor for both); otherwise the
#    engine keeps a copy of the old version, and the new version has a storage of its own.
# 7. Transient values, as ``passes._mark_transient`` marks them after the use counts: a
#    recomputed value of at least ``transient_min_bytes`` made by a ``pointwise`` op, with
#    two or more pending uses, not a view and without views, whose producer's recomputed
#    inputs are views of kept values or else not transient, not views, with a use besides
#    the producer and no more bytes in total than the value. Each such input gets the
#    value's pending uses minus one more uses; the value is dropped as soon as no op waiting
#    in the current realize needs it (``waiting_readers``), and runs again at its next use;
#    each use of it releases a use of each input.
# 8. Bounded cache, as ``realize`` bounds it (Note [Bounded recompute cache]): with
#    ``SimGraph.cache_limit`` not ``"unbounded"``, the cuts are planned from the same use
#    counts (``segment_plan``, Note [Planned segment cuts]); an automatic bound is decided at
#    the first realize, in the modelled unpack order, that would cache anything (transient
#    values are marked then if it stays unbounded); a bounded pass marks no transient values,
#    and each realize collects its ops, counts their reads (``need``), runs them in forward
#    order, adds values no remaining op reads to the open segment, closes segments at the
#    cuts (frontier kept as checkpoints, pinned until the next close, segment dropped,
#    producers owed a run that adds a use to each recomputed input) and runs dropped values
#    again when a later step needs them.
# 9. Generator states (Note [RNG replay]): a random op holds the state it replays with
#    while it may still run: until it is dead (rule 5) and its kept outputs have no live
#    use either (the engine drops the state then). Random ops that drew nothing share one
#    state. They count in ``peak_total_bytes`` only, as the
#    planner budgets activations: a CPU state is 5 KiB, which matters in tiny test models
#    only. (Not modelled, they made the measured peaks of such models look up to 17% below
#    the prediction once the engine dropped them early in backward.) While a random op runs
#    again, the generator's current state is copied aside (one more state, rule 4's
#    ``run_workspace``): a bounded pass runs dropout again late in a block's backward, where
#    that copy made the peak.
# Known limitations: the unpacked values of kept tensors are aliases (no memory); the
# order of allocations inside a step's formula is not modelled; the engine's ready queue may run
# independent branches in another order than the reverse forward order; memory outside the
# region (the loss when computed outside it) is not counted, nor are values the program
# still references after the region released them (a kept region output held by the
# caller).
"""

from __future__ import annotations

from collections.abc import Iterable

from ckpt_graph.planner.liveness_bound import Bound
from ckpt_graph.planner.liveness_transient import mark_transient
from ckpt_graph.planner.sim_graph import SimGraph, SimOp, SimResult, SimValue

__all__ = [
    "SimGraph",
    "SimOp",
    "SimResult",
    "SimValue",
    "simulate",
]


def simulate(g: SimGraph, kept_ops: Iterable[int]) -> SimResult:
    """Simulate one backward pass with the outputs of ``kept_ops`` (plus ``g.fixed``) kept.

    See Note [Backward liveness model].

    Example:
        >>> x, a, b = SimValue(8, -1, 0), SimValue(32, 0, 1), SimValue(8, 1, 2)
        >>> g = SimGraph((x, a, b), (SimOp((0,), (1,), 5), SimOp((1,), (2,), 5)), ((1, 1),))
        >>> r = simulate(g, [])  # step 1 unpacks a: op 0 runs again
        >>> r.peak_bytes, r.recompute_cost, simulate(g, [0]).kept_bytes
        (32, 5, 32)
    """
    values, ops = g.values, g.ops
    nv, n = len(values), len(ops)
    kept = [v.producer < 0 for v in values]
    for v in g.fixed:
        kept[v] = True
    for o in kept_ops:
        for v in ops[o].outputs:
            kept[v] = True
    storage = [v.storage for v in values]
    size = [values[s].nbytes if values[s].producer >= 0 else 0 for s in storage]
    refs: dict[int, int] = {}  # per storage, the values holding it (rule 3)
    cached = [False] * nv
    level = 0

    def acquire(v: int) -> None:
        nonlocal level
        if size[v]:
            s = storage[v]
            k = refs.get(s, 0)
            refs[s] = k + 1
            if k == 0:
                level += size[v]

    def release(v: int) -> None:
        nonlocal level
        if size[v]:
            s = storage[v]
            k = refs[s] - 1
            refs[s] = k
            if k == 0:
                level -= size[v]

    pass_uses = [0] * nv  # use counts of recomputed values (rule 2): Handle.pass_uses
    live_uses = [0] * nv  # live uses of every value (rule 5): Handle.live_uses
    by_step: dict[int, list[int]] = {}
    for j, v in g.saved:
        by_step.setdefault(j, []).append(v)
        live_uses[v] += 1
        if not kept[v]:
            pass_uses[v] += 1
    may_run = [False] * n  # ops that run in the pass (rule 2), then alive (rule 5)
    last = [-1] * nv  # last op that will run and reads the value (rule 8)
    for j in range(n - 1, -1, -1):
        op = ops[j]
        if any(not kept[o] and pass_uses[o] > 0 for o in op.outputs):
            may_run[j] = True
            for i in op.inputs:
                live_uses[i] += 1
                if not kept[i]:
                    pass_uses[i] += 1
                    if last[i] < 0:
                        last[i] = j
    bound = (
        Bound(g, kept, pass_uses, last, cached, release) if g.cache_limit != "unbounded" else None
    )
    if bound is not None and bound.limit == 0 and not bound.undecided:
        bound = None
    transient = mark_transient(g, kept, pass_uses) if bound is None else [False] * nv
    rng_refs = [0] * len(g.rng_bytes)  # rule 9: ops holding each generator state
    holds = [False] * n
    for j in range(n):
        if ops[j].rng >= 0 and (may_run[j] or any(live_uses[o] > 0 for o in ops[j].outputs)):
            holds[j] = True
            rng_refs[ops[j].rng] += 1
    rng_level = sum(b for b, k in zip(g.rng_bytes, rng_refs, strict=True) if k)
    # a random op run again swaps in its state: the generator's own is copied meanwhile
    swap = [g.rng_bytes[op.rng] if op.rng >= 0 else 0 for op in ops]
    waiting_readers = [0] * nv  # rule 7: Handle.waiting_readers
    ran = [False] * n
    runs = [0] * n
    peak = peak_total = cost = count = 0
    peak_step = step = -1
    grads, grads_in = g.step_grad_bytes, g.step_grad_in_bytes

    for v in range(nv):
        if kept[v] and live_uses[v] > 0:
            acquire(v)
    kept_bytes = level

    def drop(v: int) -> None:
        cached[v] = False
        release(v)

    def use(v: int) -> None:
        pass_uses[v] -= 1
        if transient[v]:  # rule 7: a use of a transient value is a use of its inputs
            for i in ops[values[v].producer].inputs:
                if not kept[i]:
                    use(i)
            if waiting_readers[v] > 0 and pass_uses[v] > 0:
                return
        elif pass_uses[v] > 0:
            return
        if cached[v]:
            drop(v)

    def check(extra: int, formula: bool = False) -> None:
        nonlocal peak, peak_total, peak_step
        peak = max(peak, level)
        # while recomputing for the step's unpacks, its own gradients are not made yet
        grad = grads.get(step, 0) if formula else grads_in.get(step, grads.get(step, 0))
        total = level + rng_level + grad + extra
        if total > peak_total:
            peak_total, peak_step = total, step

    def run(j: int) -> None:
        nonlocal cost, count
        ran[j] = True
        runs[j] += 1
        op = ops[j]
        cost += op.cost
        count += 1
        for o in op.outputs:
            acquire(o)
        check(op.run_workspace + swap[j])
        for o in op.outputs:
            if not kept[o] and pass_uses[o] > 0:
                cached[o] = True
            else:
                release(o)
        if transient[op.outputs[0]] if op.outputs else False:
            return  # its inputs are released with its value's uses
        for i in op.inputs:
            if not kept[i]:
                use(i)

    def unpin(j: int) -> None:
        for i in ops[j].inputs:
            if transient[i]:
                waiting_readers[i] -= 1
                if waiting_readers[i] == 0 and cached[i]:
                    drop(i)

    def run_bounded(j: int) -> None:  # rule 8, as realize.run_node in a bounded pass
        nonlocal cost, count
        assert bound is not None
        op = ops[j]
        cost += op.cost
        count += 1
        runs[j] += 1
        bound.owed[j] = False
        for o in op.outputs:
            acquire(o)
        check(op.run_workspace + swap[j])
        fresh = []
        for o in op.outputs:
            if not kept[o] and pass_uses[o] > 0 and not cached[o]:
                cached[o] = True
                fresh.append(o)
            else:
                release(o)
        for o in fresh:
            if o in bound.need:
                bound.active[o] = None
            else:
                bound.join(o)
        for i in op.inputs:
            if kept[i]:
                continue
            use(i)
            left = bound.need[i] - 1
            if left > 0:
                bound.need[i] = left
                continue
            del bound.need[i]
            if i in bound.active:
                del bound.active[i]
                if cached[i] and i not in bound.checkpoints:
                    bound.join(i)

    def realize_bounded(v: int) -> None:
        assert bound is not None
        order = bound.plan_realize(v)
        for k, j in enumerate(order):
            run_bounded(j)
            # the last segment stays cached
            if bound.closing and k + 1 < len(order) and bound.closes_between(j, order[k + 1]):
                bound.close()
        bound.unpin()
        bound.need, bound.active = {}, {}

    def realize(v: int) -> None:
        nonlocal bound
        if bound is not None and bound.undecided:  # rule 8: the first realize that caches
            decided = bound.decide(v)
            if decided is False:
                bound = None
                transient[:] = mark_transient(g, kept, pass_uses)
        if bound is not None and bound.limit > 0:
            realize_bounded(v)
            return
        stack = [(values[v].producer, False)]
        while stack:
            j, expanded = stack.pop()
            outs = ops[j].outputs
            if outs and transient[outs[0]]:
                if cached[outs[0]]:
                    continue
            elif ran[j]:
                if expanded:
                    unpin(j)
                continue
            if expanded:
                run(j)
                unpin(j)
                continue
            stack.append((j, True))
            for i in ops[j].inputs:
                if not kept[i]:
                    if transient[i]:
                        waiting_readers[i] += 1
                    if not cached[i]:
                        stack.append((values[i].producer, False))

    def drop_rng(j: int) -> None:  # rule 9, as release._drop_rng_if_dead
        nonlocal rng_level
        if holds[j] and not may_run[j] and not any(live_uses[o] > 0 for o in ops[j].outputs):
            holds[j] = False
            r = ops[j].rng
            rng_refs[r] -= 1
            if rng_refs[r] == 0:
                rng_level -= g.rng_bytes[r]

    def lose(v: int) -> None:  # rule 5, as release.lose_use
        stack = [v]
        while stack:
            v = stack.pop()
            live_uses[v] -= 1
            if live_uses[v] != 0:
                continue
            p = values[v].producer
            if kept[v]:
                release(v)
                if p >= 0:
                    drop_rng(p)
                continue
            if p < 0 or not may_run[p]:
                continue
            if any(not kept[o] and live_uses[o] > 0 for o in ops[p].outputs):
                continue
            may_run[p] = False
            drop_rng(p)
            stack.extend(ops[p].inputs)

    for step in range(n - 1, -1, -1):
        saves = by_step.get(step, ())
        held: list[int] = []
        for v in reversed(saves):
            if kept[v]:
                continue
            if not cached[v]:
                realize(v)
            acquire(v)
            held.append(v)
            use(v)
        check(ops[step].workspace, formula=True)
        for v in held:
            release(v)
        for v in saves:
            lose(v)
    if not g.saved:
        peak, peak_total = kept_bytes, kept_bytes + rng_level
    return SimResult(peak, peak_total, kept_bytes, cost, count, peak_step, tuple(runs))
