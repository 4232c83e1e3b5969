"""The planner is never worse than a plan it can express (issue 22 section 3).

ConvNeXt-style blocks (depthwise 7x7 convolution, channels-last LayerNorm, 1x1 MLP) in
plain PyTorch: ``memory_budget`` is not dominated by ``recompute_all`` on the same regions
(a higher measured step peak for no less recompute, counted by torch's FLOP counter), per
block (``wrap``) or one region over the model; where no plan fits, its step peak is at or
below recompute_all's; its gradients are those of the run without checkpointing, bit for
bit. See step 5b of Note [Memory budget
planning] (``ckpt_graph/planner/solve.py``). ``flops_per_byte`` is pinned.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import ckpt_graph as cg
from ckpt_graph.memory import measure
from ckpt_graph.planner.memory_budget import memory_budget

FPB = 4.0


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)  # channels last for the norm and the MLP
        y = self.fc2(self.act(self.fc1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


# (channels, blocks, batch, side): at 96 channels no plan fits 0.5 (the fallback runs), at 64
# 0.5 fits with recompute_all's plan, at 16 it fits with less recompute
SIZES = [(96, 2, 1, 14), (64, 3, 2, 16), (16, 6, 2, 32)]


def _model(dim: int, n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(n)])


def _step(model: nn.Module, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for p in model.parameters():
        p.grad = None
    run(x).sum().backward()


def _setup(
    size: tuple[int, int, int, int],
) -> tuple[nn.Sequential, torch.Tensor, list[torch.Tensor]]:
    """The model of ``size`` (channels, blocks, batch, side), its batch, and its gradients
    without checkpointing."""
    dim, n, batch, side = size
    model = _model(dim, n)
    x = torch.randn(batch, dim, side, side)
    _step(model, x, model)
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return model, x, expected


def _one_region(model: nn.Module, policy: object) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        with cg.save_recompute_policy(policy):
            return model(x)

    return forward


@dataclass(frozen=True)
class Point:
    """A planned step: measured peak, FLOPs, whether a plan fit, gradients."""

    peak: int
    flops: int
    fits: bool
    grads: list[torch.Tensor]

    def dominated_by(self, other: Point) -> bool:
        """Higher peak for no less recompute, or more recompute for no lower peak."""
        return (self.peak > other.peak and self.flops >= other.flops) or (
            self.flops > other.flops and self.peak >= other.peak
        )


def _point(model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Point:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, x, run)  # the first step records and plans
    fits = not any("no plan found" in str(w.message) for w in caught)
    counter = FlopCounterMode(display=False)
    with counter:
        _step(model, x, run)
    peak = int(measure(_step, model, x, run).peak_bytes)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return Point(peak, int(counter.get_total_flops()), fits, grads)


def _check(budget: Point, every: Point, expected: list[torch.Tensor]) -> None:
    torch.testing.assert_close(every.grads, expected, rtol=0, atol=0)
    torch.testing.assert_close(budget.grads, expected, rtol=0, atol=0)
    assert not budget.dominated_by(every), (budget.peak, budget.flops, every.peak, every.flops)
    if not budget.fits:  # the lowest peak found: recompute_all's is among the plans tried
        assert budget.peak <= every.peak, (budget.peak, every.peak)


@pytest.mark.parametrize("size", SIZES, ids=[f"c{s[0]}" for s in SIZES])
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_budget_per_block_measures_no_higher_than_recompute_all(
    size: tuple[int, int, int, int], fraction: float
) -> None:
    model, x, expected = _setup(size)
    cg.wrap(model, "recompute_all", match=ConvNeXtBlock)
    every = _point(model, model, x)
    cg.wrap(model, memory_budget(fraction, flops_per_byte=FPB), match=ConvNeXtBlock)
    _check(_point(model, model, x), every, expected)


@pytest.mark.parametrize("size", SIZES, ids=[f"c{s[0]}" for s in SIZES])
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_budget_over_one_region_measures_no_higher_than_recompute_all(
    size: tuple[int, int, int, int], fraction: float
) -> None:
    model, x, expected = _setup(size)
    every = _point(model, _one_region(model, "recompute_all"), x)
    policy = memory_budget(fraction, flops_per_byte=FPB)
    _check(_point(model, _one_region(model, policy), x), every, expected)


def test_budget_out_of_reach_warns_once_by_how_much_and_why() -> None:
    """Without the measured check, a budget no plan reaches warns at the plan: the lowest
    simulated peak, by how much it is over, and what the planner cannot change there (values
    kept whatever the plan, gradient buffers) or does not see (parameters' gradients, memory
    outside the region)."""
    model = _model(16, 2)
    x = torch.randn(2, 16, 16, 16)
    budget = 4096
    policy = memory_budget(budget, flops_per_byte=FPB)
    run = _one_region(model, policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _step(model, x, run)
        report = policy.report()
    messages = [str(w.message) for w in caught if "no plan found" in str(w.message)]
    assert len(messages) == 1, messages
    assert report is not None and not report.feasible
    peak = report.predicted_total_peak_bytes  # one region, nothing kept before it
    grads = report.predicted_total_peak_bytes - report.predicted_peak_bytes
    assert messages[0] == (
        f"ckpt_graph: memory_budget({budget}): no plan found within {budget:,} bytes for "
        f"region #0; the plan with the lowest simulated peak ({peak:,} bytes) is used, "
        f"{peak - budget:,} bytes over: 0 bytes of values kept whatever the plan (tags, other "
        f"policies, activation inputs) and {grads:,} bytes of gradient buffers and backward "
        "temporaries at the peak; parameters' gradients and memory outside the region come "
        "on top (the measured check learns them: Note [Measured budget check])"
    )
