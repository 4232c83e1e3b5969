"""Liveness simulation of a region's backward: predicted peak memory and recompute cost.

The simulator runs, without running any op, what the engine does in backward for a given
set of kept op outputs: the order in which autograd unpacks saved tensors, then the engine's
own pass rules (``engine/pass_core.py``, Note [One pass core]: use counts, transient values,
the bounded cache, realize) against a memory accountant instead of the engine's executor,
kept values freed as autograd frees saved tensors (Note [Releasing kept values]), the
gradient buffers alive at each step and the temporaries of op formulas. It works on a
small framework-free graph (:class:`SimGraph`) so planners can be tested on synthetic
graphs; ``from_region.from_region`` builds one from a recorded region.

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
#    from the last op back marks the ops that will run and adds one use per recomputed input
#    (``pass_graph.count_uses``, the function ``passes.begin_pass`` calls). A run op
#    allocates all its outputs, caches the ones with a pending use, drops the others at
#    once, then takes one use of each recomputed input; a cached value is freed when its
#    use count reaches zero. Every op runs at most once per pass (except producers of
#    transient values, rule 7), and the recompute cost of a plan is the summed cost of the
#    runs.
# 3. Memory is counted per *storage*: a view shares the storage of its base, so keeping or
#    caching a view keeps the whole base (in-place results: rule 6). Storages of region
#    inputs (parameters, the batch) are never counted: they live anyway. A region input
#    an op of the region writes while an earlier op or saved tensor still needs its old
#    value is held as a copy (batch norm's running statistics, copied before
#    ``native_batch_norm`` updates them): the copy counts as a kept value. (Not counted,
#    the copies of a tiny EfficientNet put the prediction 7% above its measured peak,
#    whose measurement missed them too: they are freed during backward.)
#    activation memory = storages of live kept values + cached or held recomputed values.
# 4. Gradients and temporaries: total memory = activation memory + gradient buffers + the
#    temporaries of the op running now. The gradient of an op output (floating, not a view)
#    is alive from the step of its last consumer (or from the start for a region output:
#    a value no op reads and autograd does not save, unlike ``native_layer_norm``'s mean
#    and ``native_batch_norm``'s inverse deviation, which get no gradient) to the step of
#    its producer; a region input's gradient (only of one that requires it) is counted at
#    its consumer's step only (parameters accumulate into an existing ``.grad`` at once;
#    a ``.grad`` of ``None``: rule 10), and so is
#    the contribution of an earlier consumer to an existing gradient (allocated, then
#    added to the buffer). Autograd sums all contributions to one tensor before its node
#    runs, so a region input read at several steps (a tied embedding and LM head, T5's
#    shared embedding) has one buffer from the last of them to the first, as an op output
#    has. The sum is in place unless the buffer is a view of a gradient: the first
#    contribution came through view ops whose formulas return views (``t``, ``view``,
#    ``transpose``: ``VIEW_GRADIENT_OPS``, as ``linear``'s weight reaches ``mm`` through
#    ``t``); then the next contribution is added out of place, one more buffer at its
#    step (measured: a tied GPT-2, BERT or T5 peaks at the embedding's step with three
#    vocabulary-sized buffers, the head's, the embedding's and their sum). An op whose
#    formula allocates no input gradient (measured: ``add``, ``clone`` hand their
#    output's gradient on) makes the gradients starting at its step share that one
#    buffer, alive until the last of them is consumed; a region input it is handed to
#    holds it (autograd's input buffer for the input) until the input's next reader
#    runs. ``sum``'s formula hands on an expanded view of its output's gradient (no
#    memory): the first contribution summed into the shared buffer is added out of
#    place, a dense buffer of the reader's size from then on (later ones are added to it
#    in place), made after that step's formula, when its workspace is freed (measured on
#    a channels-last ConvNeXt-style stack, loss ``y.sum()``: unmodelled, the residual
#    stream's gradient was missing from the first block's depthwise convolution's step,
#    131,072 bytes under its measured peak). A view op whose formula allocates
#    its input's gradient (``slice``, ``select``: a zero tensor of the input's size;
#    ``split``, ``unbind``: the concatenation; ``expand``: a sum; ``OWN_GRADIENT_VIEW_OPS``)
#    gives each output a gradient buffer of its own until the op's step, where the input's
#    is made (counting the input's whole buffer from a split's last reader on put
#    Mixtral's expert MLP, ``silu(gate) * up`` over one split, 11% above its measured
#    peak). An op's
#    ``workspace`` (what its backward formula allocates beyond the input gradients: the
#    unfolded input of a slow convolution, the normalised input of batch norm, oneDNN's
#    reordered copies) counts at its step; its
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
# 7. Transient values, marked by ``pass_core.mark_transient`` as in the engine: a
#    recomputed value of at least ``transient_min_bytes`` made by a ``pointwise`` op, with
#    two or more pending uses, not a view and without views, whose producer's recomputed
#    inputs are views of kept values or else not transient, not views, with a use besides
#    the producer and no more bytes in total than the value. Each such input gets the
#    value's pending uses minus one more uses; the value is dropped as soon as no op waiting
#    in the current realize needs it (``waiting_readers``), and runs again at its next use;
#    each use of it releases a use of each input.
# 8. Bounded cache, by the engine's ``pass_core.Bound`` (Note [Bounded recompute cache]): with
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
# 10. Parameters' gradients (Note [Parameters' gradients in backward], ``param_grads.py``):
#    a parameter whose ``.grad`` is ``None`` gets a new buffer at the step where its
#    gradient is complete (its first reader in forward order), alive from there to the end
#    of the training step; a ``.grad`` that exists is summed into in place and is memory
#    outside the step. Plan-independent: in ``peak_total_bytes`` only. (Not modelled, they
#    put transformers' ConvNeXt at bench_zoo size 3.49 MB (18%) under its measured peak
#    with gradients set to ``None``, GPT-2 7.38 MB (26%), a tiny EfficientNet 66%.)
# Known limitations: the unpacked values of kept tensors are aliases (no memory); the
# order of allocations inside a step's formula is not modelled; the engine's ready queue may run
# independent branches in another order than the reverse forward order; memory outside the
# region (the loss when computed outside it) is not counted, nor are values the program
# still references after the region released them (a kept region output held by the
# caller). The loss outside runs its backward before the region's first step, on top of
# every kept value (``SimGraph.before_backward_bytes`` adds it there once a measured step
# found it: Note [Phases of a measured step]): on the anchor GPT-2 (bench_anchor, head sizes 32 and 64) the region's
# backward measured within 0.03% of the simulated peak, and the step peaked at the loss's
# backward, 24 MiB above the kept values: the cross-entropy's saved log-softmax and its
# backward's two buffers of the logits' size
# (tests/planner/test_sim_attention_plans.py: with the loss in the region, exact).
"""

from __future__ import annotations

from collections.abc import Iterable

from ckpt_graph.engine.pass_core import Pass
from ckpt_graph.engine.pass_graph import count_uses, free_use, is_dead, last_readers
from ckpt_graph.planner.sim_graph import SimGraph, SimOp, SimResult, SimValue

__all__ = [
    "SimGraph",
    "SimOp",
    "SimResult",
    "SimValue",
    "count_uses",
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
    return _Simulation(g, kept_ops).run()


class _Accountant:
    """The simulator's executor (``pass_core.Executor``): memory by storage (rule 3),
    gradients, workspaces and generator states (rules 4 and 9), and the recompute cost.

    Attributes:
        level: bytes of the storages of live kept, cached and held values.
        step: the backward step running (op index), -1 before the first.
        rng_level: bytes of the generator states random ops hold (rule 9).
    """

    def __init__(self, g: SimGraph, kept: list[bool]) -> None:
        values = g.values
        self.g = g
        self.storage = [v.storage for v in values]
        self.size = [
            values[s].nbytes if values[s].producer >= 0 or values[s].copied else 0
            for s in self.storage
        ]
        self.refs: dict[int, int] = {}  # per storage, the values holding it
        self.level = 0
        self.peak = self.peak_total = self.cost = self.count = 0
        self.peak_step = self.step = -1
        self.rng_level = 0
        # a random op run again swaps in its state: the generator's own is copied meanwhile
        self.swap = [g.rng_bytes[op.rng] if op.rng >= 0 else 0 for op in g.ops]

    def hold_storage(self, v: int) -> None:
        if self.size[v]:
            s = self.storage[v]
            k = self.refs.get(s, 0)
            self.refs[s] = k + 1
            if k == 0:
                self.level += self.size[v]

    def free_storage(self, v: int) -> None:
        if self.size[v]:
            s = self.storage[v]
            k = self.refs[s] - 1
            self.refs[s] = k
            if k == 0:
                self.level -= self.size[v]

    def check(self, extra: int, formula: bool = False) -> None:
        """Record the peaks now, with ``extra`` bytes of workspace."""
        self.peak = max(self.peak, self.level)
        g, step = self.g, self.step
        # while recomputing for the step's unpacks, its own gradients are not made yet
        grads = g.step_grad_bytes
        grad = grads.get(step, 0) if formula else g.step_grad_in_bytes.get(step, grads.get(step, 0))
        grad += g.param_grad_steps.get(step, 0)  # rule 10
        if not formula:
            grad -= g.param_grad_made.get(step, 0)
        total = self.level + self.rng_level + grad + extra
        if total > self.peak_total:
            self.peak_total, self.peak_step = total, step

    # the executor
    def run(self, j: int) -> None:
        op = self.g.ops[j]
        self.cost += op.cost
        self.count += 1
        for o in op.outputs:
            self.hold_storage(o)
        self.check(op.run_workspace + self.swap[j])

    def hold(self, o: int) -> None:
        pass  # counted by ``run``

    def discard(self, o: int) -> None:
        self.free_storage(o)

    def done(self, j: int) -> None:
        pass

    def free(self, v: int) -> None:
        self.free_storage(v)


class _Simulation:
    """One simulated backward pass: the engine's pass rules (``pass_core.Pass``) run
    against a memory accountant, in the modelled unpack order (rule 1), with kept values
    and generator states freed as autograd frees saved tensors (rules 5 and 9)."""

    def __init__(self, g: SimGraph, kept_ops: Iterable[int]) -> None:
        values, ops = g.values, g.ops
        pg = g.pass_graph
        kept = [v.producer < 0 for v in values]
        for v in g.fixed:
            kept[v] = True
        for o in kept_ops:
            for v in ops[o].outputs:
                kept[v] = True
        self.g, self.kept = g, kept
        saves = [0] * len(values)
        self.by_step: dict[int, list[int]] = {}
        for j, v in g.saved:
            self.by_step.setdefault(j, []).append(v)
            saves[v] += 1
        # live uses of every value (rule 5); a recomputed value's pass uses are the same
        live_uses = list(saves)
        self.may_run = count_uses(pg, kept, live_uses, all_inputs=True)  # then alive
        self.live_uses = live_uses
        uses = [0 if kept[v] else live_uses[v] for v in range(len(values))]
        self.acc = acc = _Accountant(g, kept)
        self.core = core = Pass(
            pg,
            kept,
            uses,
            [False] * len(values),
            acc,
            transient_min_bytes=g.transient_min_bytes,
            bound_min_bytes=g.bound_min_bytes,
        )
        limit = g.cache_limit
        core.start(
            None if limit == "unbounded" else limit,  # type: ignore[arg-type]
            limit != "unbounded",
            last_readers(pg, kept, self.may_run),
            [k > 0 for k in saves],
        )
        self.rng_refs = [0] * len(g.rng_bytes)  # rule 9: ops holding each generator state
        self.holds = [False] * len(ops)
        for j, op in enumerate(ops):
            if op.rng >= 0 and (self.may_run[j] or any(live_uses[o] > 0 for o in op.outputs)):
                self.holds[j] = True
                self.rng_refs[op.rng] += 1
        acc.rng_level = sum(b for b, k in zip(g.rng_bytes, self.rng_refs, strict=True) if k)
        for v in range(len(values)):
            if kept[v] and live_uses[v] > 0:
                acc.hold_storage(v)
        self.kept_bytes = acc.level

    def run(self) -> SimResult:
        """Run the backward steps from the last op back (rule 1)."""
        g, kept, core, acc = self.g, self.kept, self.core, self.acc
        cached = core.cached
        for step in range(len(g.ops) - 1, -1, -1):
            acc.step = step
            saves = self.by_step.get(step, ())
            held: list[int] = []
            for v in reversed(saves):
                if kept[v]:
                    continue
                if not cached[v]:
                    core.realize(v)
                acc.hold_storage(v)
                held.append(v)
                core.use(v)
            acc.check(g.ops[step].workspace, formula=True)
            for v in held:
                acc.free_storage(v)
            for v in saves:
                self._free_use(v)
        peak, peak_total = acc.peak, acc.peak_total
        if not g.saved:
            peak, peak_total = self.kept_bytes, self.kept_bytes + acc.rng_level
        # the loss's backward outside the region, on top of every kept value: See Note
        # [Phases of a measured step].
        peak_total = max(peak_total, self.kept_bytes + g.before_backward_bytes)
        return SimResult(
            peak,
            peak_total,
            self.kept_bytes,
            acc.cost,
            acc.count,
            acc.peak_step,
            tuple(core.runs),
        )

    def _free_rng(self, j: int) -> None:
        """Rule 9, as ``passes.free_use`` frees a dead op node's generator state."""
        op = self.g.ops[j]
        if self.holds[j] and is_dead(self.g.pass_graph, self.live_uses, self.may_run, j):
            self.holds[j] = False
            self.rng_refs[op.rng] -= 1
            if self.rng_refs[op.rng] == 0:
                self.acc.rng_level -= self.g.rng_bytes[op.rng]

    def _free_use(self, v: int) -> None:
        """A saved tensor of ``v`` was freed (rule 5, ``pass_graph.free_use`` as the engine's
        ``passes.free_use``)."""
        free_use(
            self.g.pass_graph,
            self.kept,
            self.live_uses,
            self.may_run,
            v,
            self.acc.free_storage,
            self._free_rng,
        )
