"""The pass rules on synthetic integer graphs (``engine/pass_graph.py``, ``engine/pass_core.py``).

See Note [One pass core]. No framework in the loop: each graph is built by hand and the
executor records what the pass asks of it.
"""

from __future__ import annotations

import gc

import torch

import ckpt_graph as cg
from ckpt_graph.engine.pass_core import Pass
from ckpt_graph.engine.pass_graph import (
    PassGraph,
    collect,
    count_uses,
    free_use,
    is_dead,
    last_readers,
    mark_transient,
    roots,
)


def chain(n: int, nbytes: int = 8) -> PassGraph:
    """Value 0 is a region input; op j reads value j and makes value j + 1."""
    return PassGraph(
        inputs=tuple((j,) for j in range(n)),
        outputs=tuple((j + 1,) for j in range(n)),
        producer=(-1, *range(n)),
        nbytes=(nbytes,) * (n + 1),
        view=(False,) * (n + 1),
        has_views=(False,) * (n + 1),
        transient_ok=(False,) * n,
    )


class Recorder:
    """An executor that logs what the pass asks."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def run(self, j: int) -> None:
        self.log.append(("run", j))

    def hold(self, o: int) -> None:
        self.log.append(("hold", o))

    def discard(self, o: int) -> None:
        self.log.append(("discard", o))

    def done(self, j: int) -> None:
        pass

    def free(self, v: int) -> None:
        self.log.append(("free", v))


def test_count_uses_runs_only_the_ops_a_pending_value_needs() -> None:
    g = chain(4)
    kept = [True, False, True, False, False]  # value 2 kept: op 1 never runs
    uses = [0, 0, 0, 1, 0]  # one saved tensor of value 3
    runs = count_uses(g, kept, uses)
    assert runs == [False, False, True, False]
    assert uses == [0, 0, 0, 1, 0]  # op 2 reads value 2, which is kept: no pass use
    live = [0, 0, 0, 1, 0]
    assert count_uses(g, kept, live, all_inputs=True) == runs
    assert live == [0, 0, 1, 1, 0]  # live uses count the kept input too
    assert last_readers(g, kept, runs) == [-1, -1, -1, -1, -1]


def test_count_uses_skips_a_value_served_otherwise() -> None:
    g = chain(3)
    kept = [True, False, False, False]
    uses = [0, 0, 1, 0]
    assert count_uses(g, kept, uses, taken=lambda v: v == 2) == [False, False, False]
    assert uses == [0, 0, 1, 0]


def test_collect_walks_back_to_kept_or_cached_values_in_forward_order() -> None:
    g = chain(5)
    kept = [True] + [False] * 5
    order, need = collect(g, (5,), kept)
    assert order == [0, 1, 2, 3, 4]
    assert need == {5: 1, 4: 1, 3: 1, 2: 1, 1: 1}
    cached = [False, False, True, False, False, False]
    order, need = collect(g, (5,), kept, cached)
    assert order == [2, 3, 4]
    assert need == {5: 1, 4: 1, 3: 1, 2: 1}


def test_roots_follow_recomputed_views_to_their_base() -> None:
    # 0 input; op 0: 0 -> 1; op 1 views 1 -> 2; op 2 views 2 -> 3
    g = PassGraph(
        inputs=((0,), (1,), (2,)),
        outputs=((1,), (2,), (3,)),
        producer=(-1, 0, 1, 2),
        nbytes=(8, 64, 8, 8),
        view=(False, False, True, True),
        has_views=(False, True, True, False),
        transient_ok=(False, False, False),
    )
    assert roots(g, [True, False, False, False]) == [0, 1, 1, 1]
    assert roots(g, [True, False, True, False]) == [0, 1, 2, 2]  # a kept view is a root


def _pointwise_pair() -> PassGraph:
    # 0 input; op 0: 0 -> 1 (matmul-like); op 1: 1 -> 2 pointwise; ops 2, 3 read 2 and 1
    return PassGraph(
        inputs=((0,), (1,), (1, 2), (1, 2)),
        outputs=((1,), (2,), (3,), (4,)),
        producer=(-1, 0, 1, 2, 3),
        nbytes=(8, 8, 8, 8, 8),
        view=(False,) * 5,
        has_views=(False,) * 5,
        transient_ok=(False, True, False, False),
    )


def test_mark_transient_ties_the_inputs_uses_to_the_value() -> None:
    g = _pointwise_pair()
    kept = [True, False, False, False, False]
    uses = [0, 2, 2, 0, 0]  # ops 2 and 3 read both values
    transient = mark_transient(g, kept, uses, min_bytes=8)
    assert transient == [False, False, True, False, False]
    assert uses == [0, 3, 2, 0, 0]  # value 1 holds one use more per extra use of value 2
    assert mark_transient(g, kept, [0, 2, 2, 0, 0], min_bytes=9) == [False] * 5
    assert mark_transient(g, kept, [0, 2, 2, 0, 0], 8, live=[False, False, True] + [False] * 2) == (
        [False] * 5
    )


def test_a_transient_value_runs_again_at_its_next_use() -> None:
    g = _pointwise_pair()
    kept = [True, False, False, False, False]
    uses = [0, 2, 2, 0, 0]  # ops 2 and 3 saved both their inputs
    assert count_uses(g, kept, uses) == [True, True, False, False]
    assert uses == [0, 3, 2, 0, 0]  # op 1 runs and reads value 1
    rec = Recorder()
    p = Pass(g, kept, uses, [False] * 5, rec, transient_min_bytes=8)
    p.start(None, False, (), [False, True, True, False, False])
    assert p.transient[2] and p.uses == [0, 4, 2, 0, 0]
    p.realize(2)  # op 3's step unpacks value 2 ...
    p.use(2)  # ... which is freed at once: no op waits for it
    assert rec.log == [("run", 0), ("hold", 1), ("run", 1), ("hold", 2), ("free", 2)]
    assert p.cached == [False, True, False, False, False]
    rec.log.clear()
    p.realize(2)  # op 2's step: the producer runs again from the cached value 1
    p.use(2)
    p.use(1)
    p.use(1)
    assert rec.log == [("run", 1), ("hold", 2), ("free", 2), ("free", 1)]
    assert p.runs == [1, 2, 0, 0]
    assert p.uses == [0, 0, 0, 0, 0]


def test_free_use_frees_a_kept_value_after_the_last_op_that_could_read_it() -> None:
    g = chain(3)
    kept = [True, True, False, False]  # value 1 kept; 2 and 3 recomputed
    live = [0, 0, 1, 1]  # one saved tensor each of values 2 and 3
    may_run = count_uses(g, kept, live, all_inputs=True)
    assert may_run == [False, True, True] and live == [0, 1, 2, 1]
    freed: list[int] = []
    dead: list[int] = []
    free_use(g, kept, live, may_run, 3, freed.append, dead.append)
    assert freed == [] and live == [0, 1, 1, 0]  # op 2 may still run for value 2's read
    free_use(g, kept, live, may_run, 2, freed.append, dead.append)
    assert live == [0, 0, 0, 0] and freed == [1]
    assert may_run == [False, False, False]
    assert all(is_dead(g, live, may_run, j) for j in range(3))


def test_a_bounded_pass_runs_a_dropped_segment_again() -> None:
    # 8 ops in a chain, every value saved by the next op, a cache of 40 bytes (4 values):
    # segments are cut and dropped, and each op runs at most twice.
    n = 8
    g = chain(n, nbytes=10)
    kept = [True] + [False] * n
    saved = [0] + [1] * (n - 1) + [0]
    uses = list(saved)
    runs = count_uses(g, kept, uses)
    rec = Recorder()
    p = Pass(g, kept, uses, [False] * (n + 1), rec)
    plan = p.start(40, True, last_readers(g, kept, runs), [s > 0 for s in saved])
    assert plan is not None and plan.feasible and p.bound is not None and p.bound.cuts
    for step in range(n - 1, 0, -1):  # backward: op ``step`` unpacks value ``step``
        if not p.cached[step]:
            p.realize(step)
        p.use(step)
    assert p.bound is not None and p.bound.closed_segments > 0
    assert max(p.runs) == 2 and p.runs[n - 1] == 0
    assert not any(p.cached) and p.uses == [0] * (n + 1)


def test_engine_and_simulator_run_one_pass_core() -> None:
    # The engine's pass is a pass_core.Pass; a finished pass leaves nothing to the cycle
    # collector (its Bound frees through the executor, not through the Pass).
    x = torch.randn(64, 64, requires_grad=True)
    with cg.save_recompute_policy("recompute_all", cache_limit=4096) as region:
        y = x
        for _ in range(6):
            y = torch.tanh(y @ y.T)
        loss = y.sum()
    seen: list[object] = []

    def hook(grad: torch.Tensor) -> None:
        seen.append(region.pass_state.core)

    x.register_hook(hook)
    gc.collect()
    gc.disable()
    try:
        loss.backward()
        assert isinstance(seen[0], Pass)
        assert region.pass_state.core is None  # the pass ended
        seen.clear()
        assert gc.collect() == 0
    finally:
        gc.enable()
