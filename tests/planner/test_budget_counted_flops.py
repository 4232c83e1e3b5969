"""At the peak of torch's selective checkpointing, memory_budget recomputes no more counted FLOPs.

MobileNetV2-style inverted residual blocks in plain PyTorch (1x1 expansion, batch norm,
ReLU6, depthwise 3x3 convolution, batch norm, ReLU6, 1x1 projection, batch norm, residual),
called in a loop. torch's selective checkpointing per block, keeping the convolutions'
outputs and recomputing the rest, recomputes no FLOP that ``FlopCounterMode`` counts. At its
measured step peak as a byte budget, the cost model alone prefers recomputing depthwise
convolutions (few FLOPs) to recomputing batch norms and ReLU6s (many bytes); the cap of Note
[Counted FLOPs cap] (``ckpt_graph/planner/solve.py``) holds the plan to no more counted FLOPs
than the fitting hand plan with the fewest ("save matmul-class ops", torch's plan). Measured
here: the step peak is at or below torch's, the recomputed FLOPs at or below torch's (none),
the gradients those of the model without checkpointing, bit for bit. ``flops_per_byte`` is
pinned.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from sim_graphs import random_graph
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

import ckpt_graph as cg
from ckpt_graph.memory import measure
from ckpt_graph.planner.local_search import Search
from ckpt_graph.planner.memory_budget import memory_budget
from ckpt_graph.planner.sim_graph import SimGraph
from ckpt_graph.planner.solve import brute_force, candidate_ops, solve

FPB = 2.0
# Steps before the measured one: the first records and plans, the measured check compares
# the second and plans again once if it missed (Note [Measured budget check]).
STEPS = 4

aten = torch.ops.aten


class InvertedResidual(nn.Module):
    def __init__(self, dim: int, expand: int) -> None:
        super().__init__()
        hidden = dim * expand
        self.expand = nn.Conv2d(dim, hidden, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.project = nn.Conv2d(hidden, dim, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(dim)
        self.act = nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.expand(x)))
        y = self.act(self.bn2(self.dw(y)))
        return x + self.bn3(self.project(y))


class Net(nn.Module):
    """A stem, inverted residual blocks called in a loop, pooling and a linear head."""

    def __init__(self, dim: int, expand: int, n: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(dim)
        self.blocks = nn.ModuleList(InvertedResidual(dim, expand) for _ in range(n))
        self.head = nn.Linear(dim, 10)

    def forward(
        self,
        x: torch.Tensor,
        block: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda b, h: b(h),
    ) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        for b in self.blocks:
            h = block(b, h)
        return self.head(h.mean((2, 3)))


def _save_convolutions(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    if op is aten.convolution.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _torch_sac(b: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """torch's selective checkpointing of one block: convolutions kept, the rest recomputed."""
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, _save_convolutions)
    out: torch.Tensor = checkpoint(b, h, use_reentrant=False, context_fn=ctx_fn)
    return out


def _step(model: Net, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for p in model.parameters():
        p.grad = None
    run(x).square().mean().backward()


def _measured(
    model: Net, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[int, int, list[torch.Tensor]]:
    """Step peak, FLOPs of the step (``FlopCounterMode``) and gradients of ``run``."""
    counter = FlopCounterMode(display=False)
    with counter:
        _step(model, x, run)
    peak = int(measure(_step, model, x, run).peak_bytes)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return peak, int(counter.get_total_flops()), grads


@pytest.fixture
def setup() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(dim=8, expand=6, n=4)
    x = torch.randn(2, 3, 24, 24)
    return model, x


def test_budget_at_torch_sac_peak_recomputes_no_counted_flops(
    setup: tuple[Net, torch.Tensor],
) -> None:
    model, x = setup
    _, none_flops, expected = _measured(model, x, model)
    sac_peak, sac_flops, sac_grads = _measured(model, x, lambda x: model(x, _torch_sac))
    assert sac_flops == none_flops  # torch's plan recomputes no counted FLOP
    torch.testing.assert_close(sac_grads, expected, rtol=0, atol=0)

    policy = memory_budget(sac_peak, flops_per_byte=FPB)

    def planned(x: torch.Tensor) -> torch.Tensor:
        with cg.save_recompute_policy(policy):
            return model(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the budget is met: no warning
        for _ in range(STEPS):
            _step(model, x, planned)
    peak, flops, grads = _measured(model, x, planned)
    report = policy.report()
    assert report is not None and report.feasible and report.recomputed_ops > 0
    assert peak <= sac_peak, (peak, sac_peak)
    assert flops <= sac_flops, (flops - none_flops, report.method)
    torch.testing.assert_close(grads, expected, rtol=0, atol=0)


def _with_convolutions(g: SimGraph) -> SimGraph:
    """``g`` with every third op of nonzero cost named a convolution (counted FLOPs)."""
    ops = tuple(
        replace(op, name="aten.convolution.default") if op.cost and j % 3 == 0 else op
        for j, op in enumerate(g.ops)
    )
    return replace(g, ops=ops)


def test_cap_holds_the_answer_to_the_fewest_counted_flops_of_a_fitting_hand_plan() -> None:
    """On random graphs whose "convolutions" are kept by a hand plan, at that plan's peak:
    the answer fits, recomputes no more counted FLOPs than the hand plan and costs no more;
    on some of them the cheapest plan that fits (enumerated) recomputes a convolution, so
    the cap is what holds the answer there."""
    binding = 0
    for seed in range(40):
        g = _with_convolutions(random_graph(seed, 12))
        cands = candidate_ops(g)
        search = Search(g, 0, 10)
        hand = frozenset(j for j in cands if g.ops[j].name == "aten.convolution.default")
        start = search.sim(hand)
        budget = start.peak_bytes
        if search.sim(frozenset(cands)).peak_bytes <= budget:
            continue  # keeping everything fits: nothing to recompute
        optimum = brute_force(g, cands, budget)
        assert optimum is not None
        binding += search.counted(optimum.result) > search.counted(start)
        sol = solve(g, cands, budget, hand={"matmuls": hand})
        assert sol.feasible and sol.result.peak_bytes <= budget, seed
        assert search.counted(sol.result) <= search.counted(start), seed
        assert sol.result.recompute_cost <= start.recompute_cost, seed
    assert binding >= 3, binding
