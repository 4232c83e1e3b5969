"""Random simulator graphs for the solver tests and ``benchmarks/bench_milp.py``.

No framework in the loop: seeded DAGs of :class:`SimGraph` with short skips, varied sizes
and costs, on which plans are compared with enumeration or the exact MILP.
"""

from __future__ import annotations

import random

from ckpt_graph.planner.liveness import SimGraph, SimOp, SimValue


def random_graph(seed: int, n_ops: int, *, exact: bool = False) -> SimGraph:
    """A random DAG with short skips, varied sizes and costs; some ops save their output.

    Args:
        seed: the generator's seed (the same seed, the same graph).
        n_ops: number of ops, each with one output and one or two inputs among the last
            four values.
        exact: the MILP's exact class (``milp.exact_for``): no views, and every op saves
            its inputs. Otherwise one op in ten is a view of its first input and each input
            is saved with probability 1/2.
    """
    rng = random.Random(seed)
    values = [SimValue(rng.choice([8, 16, 32]), -1, 0)]
    ops: list[SimOp] = []
    saved: list[tuple[int, int]] = []
    for j in range(n_ops):
        window = range(max(0, len(values) - 4), len(values))
        ins = sorted({rng.choice(window) for _ in range(rng.choice([1, 1, 2]))})
        v = len(values)
        view = not exact and rng.random() < 0.1 and values[ins[0]].producer >= 0
        values.append(
            SimValue(rng.choice([4, 8, 16, 32, 64]), j, values[ins[0]].storage if view else v)
        )
        ops.append(SimOp(tuple(ins), (v,), 0 if view else rng.choice([1, 2, 5, 10, 50, 100])))
        saved += [(j, i) for i in ins if exact or rng.random() < 0.5]
        if rng.random() < 0.2:
            saved.append((j, v))
    return SimGraph(tuple(values), tuple(ops), tuple(saved))


def milp_graph(seed: int, n_ops: int) -> SimGraph:
    """A random DAG in the MILP's exact class: ``random_graph(seed, n_ops, exact=True)``."""
    return random_graph(seed, n_ops, exact=True)
