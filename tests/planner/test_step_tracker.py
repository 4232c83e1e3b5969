"""Tests of the step tracker of ``memory_budget`` (ckpt_graph/planner/step_tracker.py).

See rules 3 and 7 of Note [Memory budget policy]: a step ends when every region of it ran
its backward or was released; a region dropped from the step gives up its ordinal.
"""

from __future__ import annotations

import gc

import torch

import ckpt_graph as cg
from ckpt_graph.planner.step_tracker import StepTracker


def _region(x: torch.Tensor) -> tuple[cg.Region, torch.Tensor]:
    with cg.save_recompute_policy(cg.policies.save_ops()) as region:
        y = x.sin().cos()
    return region, y


def test_a_step_ends_when_every_region_ran_its_backward() -> None:
    steps = StepTracker()
    assert steps.over() and not steps.ended()  # no region: the next one starts a step
    x = torch.randn(8, requires_grad=True)
    a, y = _region(x)
    b, z = _region(y)
    assert (steps.add(a), steps.add(b)) == (0, 1)
    assert len(steps) == 2 and not steps.over() and not steps.ended()
    z.sum().backward()
    assert steps.over() and steps.ended()
    steps.new_step()
    assert len(steps) == 0 and not steps.ended()


def test_a_region_whose_graph_is_dropped_is_finished() -> None:
    steps = StepTracker()
    a, y = _region(torch.randn(8, requires_grad=True))
    steps.add(a)
    assert not steps.over()
    del y  # autograd lets go of the saved tensors: the region is released
    gc.collect()
    assert a.released and steps.over()
    del a
    gc.collect()
    assert steps.over()  # a region no longer alive counts as finished too


def test_a_dropped_region_gives_its_ordinal_to_the_next() -> None:
    steps = StepTracker()
    x = torch.randn(8, requires_grad=True)
    a, _ = _region(x)
    b, _ = _region(x)
    steps.add(a)
    steps.drop(a)
    assert steps.add(b) == 0
    assert len(steps) == 1
