"""Tests of a plan's forward memory (ckpt_graph/planner/forward_memory.py)."""

from __future__ import annotations

import warnings

import torch

import ckpt_graph as cg
from ckpt_graph.memory import measure
from ckpt_graph.planner.forward_memory import forward_peak, prune
from ckpt_graph.planner.from_region import from_region
from ckpt_graph.planner.liveness import SimGraph, SimOp, SimValue, simulate
from ckpt_graph.planner.memory_budget import memory_budget
from ckpt_graph.planner.records import Option, Seen
from ckpt_graph.planner.seeds import candidate_ops
from ckpt_graph.planner.step_budget import choose


def _gelu_chain() -> SimGraph:
    """x -> a -> b -> c = tanh(b) -> d = a * c -> e, as tanh GELU spells it.

    Op 1 (``b``, a scalar op) saves nothing; tanh saves its result, the product both
    factors, the last op its input.
    """
    values = (SimValue(8, -1, 0),) + tuple(SimValue(32, j, j + 1) for j in range(4))
    values += (SimValue(8, 4, 5),)
    ops = (
        SimOp((0,), (1,), 100),
        SimOp((1,), (2,), 1),
        SimOp((2,), (3,), 1),
        SimOp((3, 1), (4,), 1),
        SimOp((4,), (5,), 100),
    )
    return SimGraph(values, ops, ((2, 3), (3, 1), (3, 3), (4, 4)))


def test_forward_frees_a_recomputed_value_after_its_last_reader() -> None:
    g = _gelu_chain()
    # op 2: a, b, c live (b read last by op 2); op 3: a, c, d (a and c read last by op 3)
    assert forward_peak(g, []) == 3 * 32
    # kept values are held to the region's exit: at the last op, a to d and e
    assert forward_peak(g, [0, 1, 2, 3, 4]) == 4 * 32 + 8
    assert forward_peak(g, [1]) == 4 * 32


def test_a_view_shares_its_base_storage_in_forward() -> None:
    # x -> a (64) -> view v -> b (8) reading v: a lives until op 2 reads its view
    values = (SimValue(8, -1, 0), SimValue(64, 0, 1), SimValue(8, 1, 1), SimValue(8, 2, 3))
    ops = (SimOp((0,), (1,), 1), SimOp((1,), (2,), 0), SimOp((2,), (3,), 1))
    g = SimGraph(values, ops, ((2, 2),))
    assert forward_peak(g, []) == 64 + 8


def test_run_workspace_counts_at_its_op() -> None:
    g = _gelu_chain()
    ops = list(g.ops)
    ops[0] = SimOp((0,), (1,), 100, run_workspace=1000)
    assert forward_peak(SimGraph(g.values, tuple(ops), g.saved), []) == 32 + 1000


def test_prune_drops_kept_values_backward_never_reads() -> None:
    g = _gelu_chain()
    everything = [0, 1, 2, 3, 4]
    r = simulate(g, everything)
    kept, again = prune(g, everything, r)
    # b is read by op 2 only, which never runs (everything is kept); no step saves e
    assert kept == frozenset({0, 2, 3})
    assert again == simulate(g, kept)
    assert (again.peak_bytes, again.kept_bytes, again.recompute_cost) == (
        r.peak_bytes,
        r.kept_bytes,
        r.recompute_cost,
    )
    assert forward_peak(g, kept) < forward_peak(g, everything)
    # c and d recomputed: op 2 runs and reads b, which stays kept
    r = simulate(g, [0, 1])
    assert prune(g, [0, 1], r)[0] == frozenset({0, 1})


def test_prune_keeps_the_plan_when_backward_would_change() -> None:
    g = _gelu_chain()
    r = simulate(g, [])
    assert prune(g, [], r) == (frozenset(), r)


def test_the_step_budget_counts_a_region_forward() -> None:
    # Two identical regions, inputs of 10 bytes. Keeping peaks at 50 in backward but at 90
    # in forward (values held to exit that backward frees early).
    def entry(peak: int, kept: int, cost: int, forward: int) -> Option:
        from ckpt_graph.planner.liveness import SimResult

        return Option(frozenset(), SimResult(peak, peak, kept, cost, 0, -1), "t", True, forward)

    menu = [entry(50, 0, 9, 40), entry(50, 50, 0, 90)]
    graph = object()
    seen = [Seen(0, graph, 10), Seen(1, graph, 10)]  # type: ignore[arg-type]
    # the second region's forward: 10 + 0 + 10 + 90 = 110
    assert choose(seen, [menu, menu], 110) == [0, 1]
    assert choose(seen, [menu, menu], 109) == [0, 0]


class _TanhGelu(torch.nn.Module):
    """GPT-2's GELU: four of its temporaries are saved by no autograd node."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        g = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.down(g)


def test_a_plan_keeping_everything_keeps_only_what_backward_reads() -> None:
    torch.manual_seed(0)
    model = _TanhGelu(32)
    x = torch.randn(64, 32)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    policy = memory_budget(1.0, flops_per_byte=1.0)

    def forward() -> torch.Tensor:
        with cg.save_recompute_policy(policy) as region:
            y = model(x)
        box.append(region)
        return y

    box: list[cg.Region] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forward().sum().backward()  # records; planned when the next region enters
        peaks = []
        for _ in range(2):
            y = forward()
            y.sum().backward()
            peaks.append(measure(forward).peak_bytes)
    region = box[-1]
    g = from_region(region, free_ops=range(len(region.nodes)))
    kept = [n.index for n in region.nodes if any(o is not None and o.kept for o in n.outputs)]
    candidates = candidate_ops(g)
    assert set(kept) & set(candidates) < set(candidates)  # pow and the 3 ops after it are not
    assert all(g.ops[j].cost == 0 for j in set(kept) - set(candidates))  # Note [Kept views]
    assert simulate(g, kept).recompute_cost == simulate(g, candidates).recompute_cost == 0
    # measured within 0.1% when written (the output's 8 KiB included in both)
    assert abs(peaks[-1] - forward_peak(g, kept)) <= 0.01 * peaks[-1]
    # keeping every candidate would hold the four temporaries (32 KiB each) to the exit
    assert forward_peak(g, candidates) - forward_peak(g, kept) == 4 * 64 * 128 * 4
