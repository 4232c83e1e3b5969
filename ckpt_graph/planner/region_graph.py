"""A region's graph as the budget planner sees it: the ops it may decide, costs, baselines.

Built when a block of the policy exits (``region_graph``), with the activation inputs of
the region that a step's budget counts (``input_bytes``). See Note [Step budget across
regions] rule 1.

# Note [Workspaces in budget planning]
# 1. Why. The simulator counts what an op's formulas allocate beyond their results only
#    where it was measured (Note [Backward liveness model] rule 4), and a byte budget's
#    graph was built without it. On the zoo's ConvNeXt (channels last) the backward of each
#    depthwise 7x7 convolution allocates about 49 KiB per channel to form its weight's
#    gradient (12.3 MiB at 256 channels, whatever the batch); the step peaked there while
#    the simulator put the peak at a linear layer. The measured check took the difference
#    off the budget for every plan (Note [Measured budget check] rule 2), where it was a
#    peak of a few steps only: at torch's per-block peak no plan but recomputing everything
#    fit (2.15x torch's recomputed FLOPs), and at torch-sac's the step missed (warned).
#    With the workspaces (and the parameters' gradients each step holds), the simulated
#    peak of those plans equals the measured one to the byte.
# 2. Which. A byte budget's graphs only (``region_graph(..., workspaces=True)``). A fraction
#    is of the simulated peak without checkpointing and keeps its meaning and its cost
#    (none); other policies build no graph.
# 3. When. At the block's exit the region's op signatures are read
#    (``workspaces.OpSignatures``: metadata only, no tensor, op node or handle is held). If
#    this process measured all of them (a model's repeated blocks, a second policy on the
#    same model), the graph has them at once. Otherwise it is built without them and
#    ``RegionGraph.unmeasured`` is set; they are measured when the step is planned (the
#    next step's first region entry, or ``report()``): after the previous step's memory
#    is freed, before the measured check's probe starts, never while the check's step
#    runs, a ``measure()``, a probe or a profiler runs (our ``measure()`` would abandon a
#    probe), or a region records in this thread (the measured ops would be recorded). The
#    step the check measures is the program's alone. A graph that could not be measured is
#    planned without them; the next step start tries again and plans again if it could
#    (dropping the plan kept for that graph, rule 8 of Note [Memory budget policy]).
# 4. Exact gradients. The ops run on fresh tensors made from the signatures (Note
#    [Measuring op workspaces]): no tensor of the program (parameters and their ``.grad``,
#    buffers such as batch norm's running statistics, the batch) is read or written, and
#    random ops draw from a forked generator, so the caller's stream is where it was.
# 5. Cost. One measurement per distinct op signature per process (memoised): at the first
#    plan of the zoo's ConvNeXt, MobileNetV2, Swin and T5, 81-384 measured ops took
#    0.4-1.6 s on a loaded 2-core machine; repeated blocks and later policies cost nothing.
#    Memory: one op's fresh inputs, outputs, gradients and workspace at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_graph.engine.holding import without_history
from ckpt_graph.planner.blocks import find_blocks
from ckpt_graph.planner.from_region import (
    SAVED_AFTER_INPUTS_FREED,
    unmeasured_graph,
    with_workspaces,
)
from ckpt_graph.planner.hand_seeds import hand_seeds
from ckpt_graph.planner.liveness import simulate
from ckpt_graph.planner.param_grads import without_param_grads
from ckpt_graph.planner.records import RegionGraph, UnmeasuredGraph
from ckpt_graph.planner.sim_graph import SimGraph
from ckpt_graph.planner.solve import candidate_ops
from ckpt_graph.planner.workspaces import OpSignatures

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region
    from ckpt_graph.planner.records import Run

__all__ = ["fixed_before", "input_bytes", "region_graph"]


def input_bytes(region: Region, since: int, storages: set[int]) -> int:
    """Bytes of the activation inputs of ``region`` from input ``since`` on, not in ``storages``.

    Region inputs with autograd history (a previous layer's output) are activations
    the region keeps until its backward; parameters, the batch and other leaves are
    not. An input the program no longer references (``h = block(h)`` inside a ``with``
    block rebinds ``h`` before the region exits) lives only in the region's hold of it,
    and counts too. See Note [Step budget across regions] rule 1.
    """
    total = 0
    for h in region.inputs[since:]:
        if h.ref is None:
            continue
        t = h.ref()
        if t is None:  # dropped by the program: alive through the region's hold
            t = h.value if h.offload_device is None else None
            if t is None:
                continue
        elif without_history(t):  # no grad_fn read: see Note [Holding values], rule 4
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a subclass without storage
            continue
        key = storage.data_ptr()
        if key not in storages:
            storages.add(key)
            total += storage.nbytes()
    return total


def region_graph(
    region: Region,
    run: Run,
    costs: dict[int, int],
    workspaces: bool = False,
    param_grads: bool = True,
) -> RegionGraph:
    """The graph of ``run``'s block as the planner sees it, with the ops the plan may decide.

    ``costs``: recompute cost per op index (Note [Recompute cost model]). ``workspaces``:
    the graph is to have its ops' measured workspaces (a byte budget's): those this
    process measured are in it at once; otherwise ``RegionGraph.unmeasured`` measures
    them later (Note [Workspaces in budget planning]). ``param_grads``: the graph counts the
    parameters' gradients the step makes (a byte budget's; a fraction's does not: Note
    [Parameters' gradients in backward] rule 5).
    """
    end = len(region.nodes)
    free = []
    for j in range(run.start, end):
        answer = run.answers.get(j)
        node = region.nodes[j]
        if answer is None or any(o in region.tagged for o in node.outputs):
            continue
        is_kept = any(o is not None and o.kept for o in node.outputs)
        # kept against the answer only because this step freed its inputs first: the
        # plan's to decide (See Note [Values kept by a step's own frees])
        late = all(o is None or o.reason in (None, SAVED_AFTER_INPUTS_FREED) for o in node.outputs)
        if is_kept == answer or (is_kept and not answer and late):
            free.append(j)
    base = unmeasured_graph(region, costs, free)
    signatures = OpSignatures(region) if workspaces else None
    known = signatures.known() if signatures is not None else None
    g = with_workspaces(base, known)
    if not param_grads:
        g = without_param_grads(g)
    views = {  # See Note [Kept views]; detach ops have no position (-1); never candidates
        j: run.positions.get(j, -1)
        for j in free
        if g.ops[j].cost == 0
        and g.ops[j].outputs
        and all(g.values[o].storage != o for o in g.ops[j].outputs)
    }
    own = {g.values[v].storage for _, v in g.saved if g.values[v].producer >= run.start}
    baseline = sum(g.values[s].nbytes for s in own if g.values[s].producer >= 0)
    graph = RegionGraph(tuple(run.signature), g, [], {}, baseline, 0, views=views)
    blocks = find_blocks(region.nodes, g).ids
    positions = dict(run.positions)
    _derive(graph, g, free, blocks, run.start, positions)
    if signatures is not None and known is None:
        graph.unmeasured = _Unmeasured(base, signatures, free, blocks, run.start, positions)
    return graph


def _derive(
    graph: RegionGraph,
    g: SimGraph,
    free: list[int],
    blocks: tuple[int, ...],
    start: int,
    positions: dict[int, int],
) -> None:
    """Set ``g`` as ``graph``'s, with the candidates, hand plans and fixed bytes it gives."""
    candidates = candidate_ops(g, free)
    graph.g = g
    graph.candidates = candidates
    graph.positions = {j: positions[j] for j in candidates if j in positions}
    graph.hand = hand_seeds(g, candidates, blocks)
    graph.outside = fixed_before(g, start)
    graph.menu = graph.everything = None  # planned from the old graph, if at all


class _Unmeasured:
    """A region graph's ops whose workspaces are still to be measured, and how to rebuild
    the graph with them (Note [Workspaces in budget planning])."""

    def __init__(
        self,
        base: UnmeasuredGraph,
        signatures: OpSignatures,
        free: list[int],
        blocks: tuple[int, ...],
        start: int,
        positions: dict[int, int],
    ) -> None:
        self._base = base
        self._signatures = signatures
        self._rest = (free, blocks, start, positions)

    def __call__(self, graph: RegionGraph) -> bool:
        """Measure the workspaces and rebuild ``graph`` with them; whether it could."""
        workspaces = self._signatures.measure()
        if workspaces is None:
            return False
        free, blocks, start, positions = self._rest
        _derive(graph, with_workspaces(self._base, workspaces), free, blocks, start, positions)
        graph.unmeasured = None
        return True


def fixed_before(g: SimGraph, start: int) -> int:
    """Bytes of the fixed values made before op ``start`` that backward still reads.

    Values the region kept before the policy's block opened (another policy's block of the
    same region) are memory the plan cannot change: they count against its budget as
    ``RegionGraph.outside``. Only storages the simulated pass acquires count (a fixed value
    no saved tensor or recomputed op reads, e.g. a tagged block output, is not in the
    simulated peak). Before, this was the fixed kept bytes less *every* fixed storage made
    in the block, counted or not: a tagged output nobody saves made it negative, and a
    step's limit then went to minus infinity (issue 21 item 3).
    """
    result = simulate(g, [])
    read = {g.values[v].storage for _, v in g.saved}
    for j, op in enumerate(g.ops):
        if result.runs and result.runs[j]:
            read.update(g.values[i].storage for i in op.inputs)
    before = {
        g.values[v].storage
        for v in g.fixed
        if 0 <= g.values[v].producer < start and g.values[v].storage in read
    }
    return sum(g.values[s].nbytes for s in before if g.values[s].producer >= 0)
