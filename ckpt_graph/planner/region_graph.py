"""A region's graph as the budget planner sees it: the ops it may decide, costs, baselines.

Built when a block of the policy exits (``region_graph``), with the activation inputs of
the region that a step's budget counts (``input_bytes``). See Note [Step budget across
regions] rule 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_graph.engine.holding import without_history
from ckpt_graph.planner.blocks import find_blocks
from ckpt_graph.planner.from_region import from_region
from ckpt_graph.planner.hand_seeds import hand_seeds
from ckpt_graph.planner.liveness import simulate
from ckpt_graph.planner.records import RegionGraph
from ckpt_graph.planner.sim_graph import SimGraph
from ckpt_graph.planner.solve import candidate_ops

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


def region_graph(region: Region, run: Run, costs: dict[int, int]) -> RegionGraph:
    """The graph of ``run``'s block as the planner sees it, with the ops the plan may decide.

    ``costs``: recompute cost per op index (Note [Recompute cost model]).
    """
    end = len(region.nodes)
    free = []
    for j in range(run.start, end):
        answer = run.answers.get(j)
        node = region.nodes[j]
        if answer is None or any(o in region.tagged for o in node.outputs):
            continue
        is_kept = any(o is not None and o.kept for o in node.outputs)
        if is_kept == answer:
            free.append(j)
    g = from_region(region, costs, free)
    candidates = candidate_ops(g, free)
    hand = hand_seeds(g, candidates, find_blocks(region.nodes, g).ids)
    own = {g.values[v].storage for _, v in g.saved if g.values[v].producer >= run.start}
    baseline = sum(g.values[s].nbytes for s in own if g.values[s].producer >= 0)
    outside = fixed_before(g, run.start)
    positions = {j: run.positions[j] for j in candidates if j in run.positions}
    views = {  # See Note [Kept views]; detach ops have no position (-1)
        j: run.positions.get(j, -1)
        for j in free
        if j not in positions
        and g.ops[j].cost == 0
        and g.ops[j].outputs
        and all(g.values[o].storage != o for o in g.ops[j].outputs)
    }
    return RegionGraph(
        tuple(run.signature), g, candidates, positions, baseline, outside, hand, views=views
    )


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
