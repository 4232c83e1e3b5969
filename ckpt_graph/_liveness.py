"""Liveness simulation of a region's backward: predicted peak memory and recompute cost.

The simulator replays, without running any op, what the engine does in backward for a given
set of kept op outputs: the order in which autograd unpacks saved tensors, the use counts of
``realize.py`` (see Note [Use counts and freeing]), the values cached while they still have a
pending use, and the gradient buffers alive at each step. It works on a small framework-free
graph (:class:`SimGraph`) so planners can be tested on synthetic graphs; :func:`from_region`
builds one from a recorded region.

# Note [Backward liveness model]
# 1. Unpack order. Saved tensors are grouped into backward *steps*: the op node whose
#    autograd node saved them (inputs are saved just before the op is recorded, outputs just
#    after, so a save logged after ``n`` recorded ops belongs to op ``n`` if the value is one
#    of its inputs, else to op ``n - 1``). Autograd runs its nodes in reverse topological
#    order, which for one region is the reverse forward order (sequence numbers grow with the
#    forward), so steps run from the last op back and a step unpacks all its saved tensors,
#    which stay alive (*held*) until the step ends.
# 2. Realize. Use counts start at the number of saved tensors per recomputed value; one sweep
#    from the last op back marks the ops that will run and adds one use per recomputed input,
#    exactly as ``realize.begin_pass``. A run op allocates all its outputs, caches the ones
#    with a pending use, drops the others at once, then releases one use of each recomputed
#    input; a cached value is freed when its use count reaches zero. Every op runs at most
#    once per pass, so the recompute cost of a plan is the cost of the ops marked to run.
# 3. Memory is counted per *storage*: a view shares the storage of its base, so keeping or
#    caching a view keeps the whole base (in-place results: rule 6). Storages of region
#    inputs (parameters, the batch) are never counted: they live anyway.
#    activation memory = storages of live kept values + cached or held recomputed values.
# 4. Gradient buffers: the gradient of an op output (floating, not a view) is alive from the
#    step of its last consumer (or from the start for a region output) to the step of its
#    producer; a region input's gradient is counted at each consumer's step only (parameters
#    accumulate into ``.grad`` at once). They do not depend on the plan, so they are computed
#    once per graph (``step_grad_bytes``) and added to the total, not to the activation peak.
# 5. Kept values count only if a saved tensor may need them when backward starts: live
#    uses = saved tensors + ops that must run for a recomputed value, as the engine counts
#    them at region exit (Note [Releasing kept values]); kept values nobody needs are
#    released there and are not counted. Their release during the pass, as autograd frees
#    saved tensors, is not modelled (tried: it predicted 13-27% below the measured peak of
#    budget plans, so the engine frees later than that model); peaks are mostly reached
#    early in backward, where nearly every kept value is still needed.
# 6. An in-place op returns a new version in the storage of the written value when nothing
#    used the old version before (the engine then keeps one tensor for both); otherwise the
#    engine keeps a copy of the old version, and the new version has a storage of its own.
# Known limitations: temporaries of backward formulas, the unpacked values of kept tensors
# (aliases, no memory) and the timing of frees inside a step are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .region import Region

__all__ = ["SimGraph", "SimOp", "SimResult", "SimValue", "from_region", "kept_ops_of", "simulate"]


@dataclass(frozen=True)
class SimValue:
    """One value: an op output or a region input.

    Attributes:
        nbytes: bytes of the value's storage if it owns it (ignored for views).
        producer: index of the producing op, -1 for a region input.
        storage: id of the value owning the storage (itself unless a view).
    """

    nbytes: int
    producer: int
    storage: int


@dataclass(frozen=True)
class SimOp:
    """One op: value ids in and out, and its recompute cost."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    cost: int
    name: str = ""


@dataclass(frozen=True)
class SimGraph:
    """A region's graph as the simulator sees it (no framework objects).

    Attributes:
        values: every value, indexed by id.
        ops: the ops in forward (topological) order.
        saved: ``(step op index, value id)`` per saved tensor, in forward order.
        fixed: value ids kept whatever the plan says (region inputs are always kept).
        step_grad_bytes: gradient bytes alive at each step (op index), see Note [Backward
            liveness model] rule 4; empty for graphs without gradients.

    Example:
        >>> g = SimGraph(
        ...     values=(SimValue(8, -1, 0), SimValue(8, 0, 1), SimValue(8, 1, 2)),
        ...     ops=(SimOp((0,), (1,), 5), SimOp((1,), (2,), 5)),
        ...     saved=((1, 1), (1, 2)),
        ... )
        >>> simulate(g, []).recompute_cost, simulate(g, [0, 1]).peak_bytes
        (10, 16)
    """

    values: tuple[SimValue, ...]
    ops: tuple[SimOp, ...]
    saved: tuple[tuple[int, int], ...]
    fixed: frozenset[int] = frozenset()
    step_grad_bytes: Mapping[int, int] = field(default_factory=dict)

    def saved_bytes(self) -> int:
        """Activation bytes kept without checkpointing: distinct op-made saved storages."""
        roots = {self.values[v].storage for _, v in self.saved}
        return sum(self.values[s].nbytes for s in roots if self.values[s].producer >= 0)


@dataclass(frozen=True)
class SimResult:
    """What one simulated backward pass costs.

    Attributes:
        peak_bytes: highest activation memory (kept + cached + held storages).
        peak_total_bytes: highest activation + gradient memory.
        kept_bytes: storages of kept values some saved tensor still needs when backward starts.
        recompute_cost: summed cost of the ops run in backward.
        recomputed_ops: number of ops run in backward.
        peak_step: op index of the step where ``peak_total_bytes`` was reached (-1 if none).
    """

    peak_bytes: int
    peak_total_bytes: int
    kept_bytes: int
    recompute_cost: int
    recomputed_ops: int
    peak_step: int


def simulate(g: SimGraph, kept_ops: Iterable[int]) -> SimResult:
    """Simulate one backward pass with the outputs of ``kept_ops`` (plus ``g.fixed``) kept.

    See Note [Backward liveness model].
    """
    values, ops = g.values, g.ops
    nv = len(values)
    kept = [v.producer < 0 for v in values]
    for v in g.fixed:
        kept[v] = True
    for o in kept_ops:
        for v in ops[o].outputs:
            kept[v] = True
    storage = [v.storage for v in values]
    size = [values[s].nbytes if values[s].producer >= 0 else 0 for s in storage]
    pending = [0] * nv
    alive = [0] * nv  # live uses, kept values included (see rule 5)
    for _, v in g.saved:
        alive[v] += 1
        if not kept[v]:
            pending[v] += 1
    runs = [False] * len(ops)
    cost = count = 0
    for j in range(len(ops) - 1, -1, -1):
        op = ops[j]
        if any(not kept[o] and pending[o] > 0 for o in op.outputs):
            runs[j] = True
            cost += op.cost
            count += 1
            for i in op.inputs:
                alive[i] += 1
                if not kept[i]:
                    pending[i] += 1
    refs: dict[int, int] = {}
    cached = [False] * nv
    ran = [False] * len(ops)
    live = 0
    peak = peak_total = 0
    peak_step = -1
    grads = g.step_grad_bytes
    step = -1

    def acquire(v: int) -> None:
        nonlocal live
        s = storage[v]
        if size[v]:
            n = refs.get(s, 0)
            refs[s] = n + 1
            if n == 0:
                live += size[v]

    def release(v: int) -> None:
        nonlocal live
        s = storage[v]
        if size[v]:
            n = refs[s] - 1
            refs[s] = n
            if n == 0:
                live -= size[v]

    for v in range(nv):
        if kept[v] and alive[v] > 0:
            acquire(v)
    kept_bytes = live

    def use(v: int) -> None:
        pending[v] -= 1
        if pending[v] <= 0 and cached[v]:
            cached[v] = False
            release(v)

    def check() -> None:
        nonlocal peak, peak_total, peak_step
        act = live
        total = act + grads.get(step, 0)
        peak = max(peak, act)
        if total > peak_total:
            peak_total, peak_step = total, step

    def run(j: int) -> None:
        ran[j] = True
        op = ops[j]
        for o in op.outputs:
            acquire(o)
        check()
        for o in op.outputs:
            if not kept[o] and pending[o] > 0:
                cached[o] = True
            else:
                release(o)
        for i in op.inputs:
            if not kept[i]:
                use(i)

    def realize(v: int) -> None:
        stack = [(values[v].producer, False)]
        while stack:
            j, expanded = stack.pop()
            if ran[j]:
                continue
            if expanded:
                run(j)
                continue
            stack.append((j, True))
            for i in ops[j].inputs:
                if not kept[i] and not cached[i]:
                    stack.append((values[i].producer, False))

    saved = g.saved
    k = len(saved) - 1
    while k >= 0:
        step = saved[k][0]
        held: list[int] = []
        while k >= 0 and saved[k][0] == step:
            v = saved[k][1]
            k -= 1
            if kept[v]:
                continue
            if not cached[v]:
                realize(v)
            acquire(v)
            held.append(v)
            use(v)
        check()
        for v in held:
            release(v)
    if not saved:
        peak = peak_total = kept_bytes
    return SimResult(peak, peak_total, kept_bytes, cost, count, peak_step)


def kept_ops_of(region: Region) -> frozenset[int]:
    """Indices of the region's op nodes with an output kept by a policy or tag."""
    return frozenset(
        n.index
        for n in region.nodes
        if any(o is not None and o.kept and not o.reason.startswith("engine") for o in n.outputs)  # type: ignore[union-attr]
    )


def from_region(
    region: Region, costs: Mapping[int, int] | None = None, free_ops: Iterable[int] = ()
) -> SimGraph:
    """Build the :class:`SimGraph` of a recorded region.

    Args:
        region: a region whose forward has run (values may be released; metadata is used).
        costs: recompute cost per op index; missing ops cost the elements of their outputs;
            ops whose outputs are all views cost 0.
        free_ops: ops whose kept outputs are left to the plan (not fixed); outputs of every
            other op are fixed as the forward decided them.

    Example:
        >>> g = from_region(region)  # doctest: +SKIP
        >>> simulate(g, kept_ops_of(region)).peak_bytes  # doctest: +SKIP
    """
    free = set(free_ops)
    vid: dict[int, int] = {}
    values: list[SimValue] = []
    fixed: set[int] = set()
    floating: list[bool] = []
    for inp in region.inputs:
        vid[id(inp)] = len(values)
        values.append(SimValue(inp.nbytes, -1, len(values)))
        floating.append(inp.dtype.is_floating_point)
    ops: list[SimOp] = []
    used: set[int] = set()  # values consumed so far (ops and saves), for rule 6
    saves = sorted(((n, id(h)) for n, h in region.saved), key=lambda e: e[0])
    next_save = 0
    for node in region.nodes:
        while next_save < len(saves) and saves[next_save][0] <= node.index:
            used.add(saves[next_save][1])
            next_save += 1
        ins = tuple(vid[id(i)] for i in node.inputs if id(i) in vid)
        outs: list[int] = []
        info = node.info
        for out in node.outputs:
            if out is None:
                continue
            v = len(values)
            vid[id(out)] = v
            root = v
            if (ins and out.is_view and not info.returns_written) or (
                ins and info.returns_written and id(node.inputs[0]) not in used
            ):
                root = values[ins[0]].storage
            values.append(SimValue(out.nbytes, node.index, root))
            floating.append(out.dtype.is_floating_point and root == v)
            outs.append(v)
            if out.kept and (node.index not in free or (out.reason or "").startswith("engine")):
                fixed.add(v)
        if all(o is None or o.is_view for o in node.outputs):
            cost = 0  # views compute nothing
        elif costs is not None and node.index in costs:
            cost = costs[node.index]
        else:
            cost = sum(o.shape.numel() for o in node.outputs if o is not None)
        ops.append(SimOp(ins, tuple(outs), cost, info.name))
        used.update(id(i) for i in node.inputs)
    saved: list[tuple[int, int]] = []
    last = 0
    n_ops = len(ops)
    for n, packed in region.saved:
        sv = vid.get(id(packed))
        if sv is None:
            continue
        step = n if n < n_ops and sv in ops[n].inputs else n - 1
        last = max(last, min(max(step, 0), n_ops - 1))
        saved.append((last, sv))
    return SimGraph(
        tuple(values),
        tuple(ops),
        tuple(saved),
        frozenset(fixed),
        _grad_bytes(values, ops, floating),
    )


def _grad_bytes(values: list[SimValue], ops: list[SimOp], floating: list[bool]) -> dict[int, int]:
    """Gradient bytes alive per step. See Note [Backward liveness model] rule 4."""
    n = len(ops)
    last_use = [-1] * len(values)
    for j, op in enumerate(ops):
        for i in op.inputs:
            last_use[values[i].storage] = j
    delta = [0] * (n + 2)
    for v, val in enumerate(values):
        if not floating[v] or val.storage != v:
            continue
        if val.producer < 0:
            continue
        end = last_use[v] if last_use[v] >= 0 else n - 1
        delta[val.producer] += val.nbytes
        delta[end + 1] -= val.nbytes
    out: dict[int, int] = {}
    level = 0
    for j in range(n):
        level += delta[j]
        out[j] = level
    for j, op in enumerate(ops):
        if op.outputs and all(values[o].storage != o for o in op.outputs):
            continue  # a view op: the gradient is formed where the view is consumed
        for i in op.inputs:
            root = values[i].storage
            if values[root].producer < 0 and floating[root]:
                out[j] += values[i].nbytes if values[i].nbytes else values[root].nbytes
    return out
