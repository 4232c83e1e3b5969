"""The simulator on a channels-last residual stack with parameters' gradients of ``None``
(issue 22 §3: pgrad and ws together over-predicted a ConvNeXt-style byte budget by 3%).

Two causes, each measured here on ConvNeXt-style blocks (channels-last depthwise 7x7
convolution, batch norm, permute, MLP, residual add; loss ``y.sum()`` in the region):

* Note [Permuted gradients]: batch norm's formula gives a channels-last input a
  channels-last gradient, so the convolution before it copies nothing (counted, one block
  was predicted 131,072 bytes above its measured peak).
* Note [Backward liveness model] rule 4: ``sum`` hands on an expanded gradient; the first
  contribution summed into the residual stream's shared buffer makes it dense, and a
  region input handed that buffer holds it until its next reader (unmodelled, three
  blocks were predicted 131,072 bytes below their measured peak once the copy was gone).

Measured peaks are whole steps (``run_region``); the prediction counts the loss's own
gradient (4 bytes, a region output's), which the measurement's base level already holds.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from test_budget_workspaces import CHANNELS, Block
from test_liveness import predicted_peak, run_region

from ckpt_graph.planner.from_region import grad_bytes, step_grads
from ckpt_graph.planner.sim_graph import SimOp, SimValue

pytestmark = pytest.mark.usefixtures("one_thread")

LOSS_GRAD = 4  # the scalar loss's gradient: a region output's buffer, in the measured base


def _stack(blocks: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(CHANNELS) for _ in range(blocks)]).train()
    x = torch.randn(8, CHANNELS, 8, 8).contiguous(memory_format=torch.channels_last)
    return model, x.requires_grad_()


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
@pytest.mark.parametrize("blocks", [1, 3])
def test_predicted_peak_is_measured_on_a_channels_last_residual_stack(
    blocks: int, policy: Any
) -> None:
    model, x = _stack(blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_region(model, (x,), policy, loss_fn=lambda y: y.sum(), grads="none")
    assert predicted_peak(run) == run.measured + LOSS_GRAD, (predicted_peak(run), run.measured)


def _two_residual_steps() -> tuple[list[SimValue], list[SimOp], list[bool]]:
    """x -> a = tanh(x) (0) -> c = x + a (1) -> d = tanh(c) (2) -> e = c + d (3) ->
    s = sum(e) (4); 8-byte values, a 4-byte loss."""
    values = [SimValue(8, -1, 0)] + [SimValue(8, j, j + 1) for j in range(4)]
    values.append(SimValue(4, 4, 5))
    ops = [
        SimOp((0,), (1,), 1, "aten.tanh.default"),
        SimOp((0, 1), (2,), 1, "aten.add.Tensor"),
        SimOp((2,), (3,), 1, "aten.tanh.default"),
        SimOp((2, 3), (4,), 1, "aten.add.Tensor"),
        SimOp((4,), (5,), 1, "aten.sum.default"),
    ]
    return values, ops, [True] * len(values)


def test_the_first_sum_into_an_expanded_gradient_makes_a_dense_buffer() -> None:
    values, ops, floating = _two_residual_steps()
    passthrough = [1, 3, 4]  # add and sum allocate no input gradient (measured)
    # step 2: c's contribution and its out-of-place sum with the expanded gradient; the
    # dense sum then lives through steps 1 and 0 (x's input buffer holds it until step 0,
    # where tanh's contribution is added in place); the loss's 4 bytes throughout
    assert grad_bytes(values, ops, floating, passthrough) == {0: 20, 1: 12, 2: 20, 3: 4, 4: 4}
    # the sum is made after the formula: a workspace freed by then hides it at its step
    ops[2] = SimOp((2,), (3,), 1, "aten.tanh.default", workspace=100)
    grads, unpacking = step_grads(values, ops, floating, passthrough)
    assert (grads[2], unpacking[2]) == (12, 4)
    ops[2] = SimOp((2,), (3,), 1, "aten.tanh.default", workspace=5)
    assert step_grads(values, ops, floating, passthrough)[0][2] == 12 + 8 - 5
