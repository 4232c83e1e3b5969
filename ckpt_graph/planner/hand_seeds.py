"""Hand plans as seeds of the memory-budget solver: the configurations people write by hand.

# Note [Hand seeds]
# A plan the solver returns must never be worse, under its own cost model, than the simple
# plans a user would write by hand and that the graph can express. Those plans are seeds of
# ``_budget_solve.solve``: each is simulated; every one that fits the budget is a candidate
# answer as is (so the answer costs at most as much as each fitting hand plan), and the
# cheapest fitting one also starts a local search. The hand plans, as sets of kept ops:
#   - ``matmuls``: every matmul-class op (mm, addmm, bmm, baddbmm, convolution, attention):
#     JAX's ``dots_saveable``, torch SAC saving matmuls.
#   - ``dense matmuls/<r>``: the matmul-class ops whose recompute costs at least r FLOPs per
#     byte of their own outputs, for each distinct r of the region's matmuls (at most
#     ``_DENSITY_SEEDS`` of them, spread over the sorted values): Megatron's selective
#     recompute, generalised. In attention spelt out op by op, QK^T costs 2 x head size
#     FLOPs per score and holds a T x T tensor, while a linear layer costs 2 x its input
#     width per output: dropping the matmuls below r recomputes the attention core (QK^T,
#     then softmax and dropout, which no matmul seed keeps) from the kept Q, K, V, as
#     Megatron does, and keeps the projections and the MLP. No model-specific threshold:
#     every distinct density is a seed, and the solver simulates each.
#   - with *blocks* (below): ``block inputs``, every block's inputs (torch.utils.checkpoint
#     per block); ``blocks/k`` for k = 1..N, the outputs of blocks k-1, 2k-1, ... and of the
#     last block plus the first block's inputs (checkpoint over groups of k blocks, Chen et
#     al.'s sqrt(N) at k = round(sqrt(N))); ``matmuls+block inputs`` (SAC per block). These
#     also keep what torch leaves outside its checkpoints: the values saved by ops outside
#     every block (embedding, head, loss).
# A value is kept through the op owning its storage (a view's base), when that op is a
# candidate; values the plan cannot keep (region inputs, fixed values) are kept anyway.
# Blocks come from ``blocks.find_blocks`` (Note [Block boundaries]): the module calls that
# ran each op (blocks called in a loop without a parent module, stages of blocks with
# downsampling layers between them), else module names, else repeated op sequences. A region
# over one layer has no blocks: only the matmul seeds are tried.
# Measured (tests/planner/test_planner_dominance.py): on synthetic 6-block graphs, at the peak of
# "block inputs" the other seeds found no plan that fits in 6 of 12 graphs (9 blocks: 11 of
# 12, also at "blocks/2"); with hand seeds every answer costs at most each fitting hand
# plan there and on the zoo's gpt, mlp and cnn. Measured end to end against torch (peak
# and FLOPs at each torch configuration's peak): benchmarks/results_pareto.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_graph.planner.liveness import SimGraph
from ckpt_graph.policies.builtins import MATMUL_OP_NAMES

__all__ = ["MATMUL_OPS", "counted_flops", "hand_seeds"]

# At most this many ``dense matmuls/<r>`` seeds (Note [Hand seeds]).
_DENSITY_SEEDS = 8

#: Short aten names of matmul-class ops (costed by FLOPs, kept by the ``matmuls`` seed): the
#: ops ``policies.save_matmuls`` keeps, so the seed is that policy's plan.
MATMUL_OPS = frozenset(MATMUL_OP_NAMES)


def short_name(name: str) -> str:
    """``"aten.mm.default"`` -> ``"mm"``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 3 else name


def counted_flops(g: SimGraph) -> tuple[int, ...]:
    """FLOPs each op of ``g`` adds to ``FlopCounterMode``'s count per run: its cost if it is
    matmul-class (costed by its FLOPs, Note [Recompute cost model]), else 0.

    See Note [Counted FLOPs cap].

    Example:
        >>> counted_flops(graph)  # doctest: +SKIP
        (0, 2097152, 0, 0)
    """
    return tuple(op.cost if short_name(op.name) in MATMUL_OPS else 0 for op in g.ops)


def _dense_matmuls(g: SimGraph, matmuls: frozenset[int]) -> dict[str, frozenset[int]]:
    """``dense matmuls/<r>`` plans of Note [Hand seeds]: matmuls of >= r FLOPs per byte."""
    values = g.values
    density: dict[int, float] = {}
    for j in matmuls:
        nbytes = sum(
            values[o].nbytes
            for o in g.ops[j].outputs
            if values[o].storage == o and o not in g.fixed
        )
        if nbytes > 0:
            density[j] = g.ops[j].cost / nbytes
    levels = sorted(set(density.values()))[1:]  # the lowest keeps every matmul: "matmuls"
    if len(levels) > _DENSITY_SEEDS:
        step = (len(levels) - 1) / (_DENSITY_SEEDS - 1)
        levels = [levels[round(i * step)] for i in range(_DENSITY_SEEDS)]
    return {
        f"dense matmuls/{r:.3g}": frozenset(j for j, d in density.items() if d >= r) for r in levels
    }


def hand_seeds(
    g: SimGraph, candidates: Sequence[int], blocks: Sequence[int] | None = None
) -> dict[str, frozenset[int]]:
    """The hand plans of Note [Hand seeds], as kept candidate ops, by name.

    Args:
        g: the region's graph.
        candidates: ops a plan may keep.
        blocks: block number of each op of ``g`` (-1 outside blocks), e.g. from
            ``blocks.find_blocks``; ``None`` or a length other than ``len(g.ops)``: no blocks.

    Example:
        >>> hand_seeds(graph, candidate_ops(graph), [-1, 0, 0, 1, 1, -1])  # doctest: +SKIP
        {'matmuls': frozenset({1, 3}), 'block inputs': frozenset({0, 2}), ...}
    """
    cands = set(candidates)
    values, ops = g.values, g.ops

    def owner(v: int) -> set[int]:
        p = values[values[v].storage].producer
        return {p} if p in cands else set()

    seeds: dict[str, frozenset[int]] = {}
    matmuls = frozenset(j for j in cands if short_name(ops[j].name) in MATMUL_OPS)
    if matmuls:
        seeds["matmuls"] = matmuls
        seeds.update(_dense_matmuls(g, matmuls))
    if blocks is None or len(blocks) != len(ops) or max(blocks, default=-1) < 1:
        return seeds
    n_blocks = max(blocks) + 1
    inputs: list[set[int]] = [set() for _ in range(n_blocks)]
    outputs: list[set[int]] = [set() for _ in range(n_blocks)]
    outside: set[int] = set()

    def crossing(v: int, b: int) -> None:
        """Value ``v`` is read by an op or a saved tensor of block ``b`` (-1: outside)."""
        p = values[v].producer
        if p < 0:
            return
        pb = blocks[p]
        if b >= 0 and pb != b:
            inputs[b] |= owner(v)
        if pb >= 0 and pb != b:
            outputs[pb] |= owner(v)

    for j, op in enumerate(ops):
        for v in op.inputs:
            crossing(v, blocks[j])
    for step, v in g.saved:
        crossing(v, blocks[step])
        if blocks[step] < 0:
            outside |= owner(v)
    every_input = frozenset(set().union(*inputs) | outside)
    seeds["block inputs"] = every_input
    if matmuls:
        seeds["matmuls+block inputs"] = matmuls | every_input
    for k in range(1, n_blocks + 1):
        kept = set(inputs[0]) | outside
        for b in range(n_blocks):
            if (b + 1) % k == 0 or b == n_blocks - 1:
                kept |= outputs[b]
        seeds[f"blocks/{k}"] = frozenset(kept)
    unique: dict[frozenset[int], str] = {}
    for name, plan in seeds.items():
        unique.setdefault(plan, name)
    return {name: plan for plan, name in unique.items()}
