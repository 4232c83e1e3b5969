"""Gradient buffers of the liveness simulator (Note [Backward liveness model] rule 4), on
hand-built graphs, and checked against autograd's real allocations where it matters.

Autograd sums the contributions to one tensor's gradient in a buffer before the tensor's
node runs: a region input read at several steps (a tied embedding and LM head) holds one
buffer from the last step that reads it to the first, and a buffer that is a view of a
gradient (the head's weight reaches ``mm`` through ``t``) takes the next contribution out of
place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ckpt_graph.memory import measure
from ckpt_graph.planner.from_region import grad_bytes
from ckpt_graph.planner.sim_graph import SimOp, SimValue

W = 64  # bytes of the weight and of each of its gradient contributions


def tied(head_through_t: bool) -> tuple[list[SimValue], list[SimOp], list[bool]]:
    """ids -> embedding(w) -> h -> tanh -> a -> [t(w) ->] mm(a, w) -> y -> sum -> loss."""
    values = [SimValue(W, -1, 0), SimValue(16, -1, 1)]  # the weight, the ids
    values += [SimValue(8, 0, 2), SimValue(8, 1, 3)]  # h, a
    ops = [SimOp((0, 1), (2,), 1, "aten.embedding.default"), SimOp((2,), (3,), 1, "tanh")]
    w = 0
    if head_through_t:
        values.append(SimValue(W, 2, 0, True))  # t(w): a view of the weight
        ops.append(SimOp((0,), (4,), 0, "aten.t.default"))
        w = 4
    y = len(values)
    values += [SimValue(32, len(ops), y), SimValue(4, len(ops) + 1, y + 1)]
    ops += [SimOp((3, w), (y,), 1, "aten.mm.default"), SimOp((y,), (y + 1,), 1, "sum")]
    floating = [True, False] + [True] * (len(values) - 2)
    return values, ops, floating


def test_a_weight_read_at_two_steps_holds_one_buffer_between_them() -> None:
    values, ops, floating = tied(head_through_t=False)
    g = grad_bytes(values, ops, floating)
    # step 2 (mm) makes w's buffer; it stays through step 1 until the embedding's step 0
    # adds its contribution in place (no third buffer)
    assert g[2] == 32 + W + 8  # y's gradient, w's buffer, a's gradient
    assert g[1] == W + 8 + 8  # w's buffer, a's and h's gradients
    assert g[0] == W + W + 8  # w's buffer and the embedding's contribution, h's gradient


def test_a_buffer_that_is_a_view_takes_the_next_contribution_out_of_place() -> None:
    values, ops, floating = tied(head_through_t=True)
    g = grad_bytes(values, ops, floating)
    assert g[3] == 32 + W + 8  # the view op t is step 2: mm is step 3
    assert g[0] == 3 * W + 8  # w's buffer (a view), the embedding's contribution, their sum


def test_a_weight_read_once_counts_at_its_step_only() -> None:
    values = [SimValue(W, -1, 0), SimValue(8, -1, 1), SimValue(8, 0, 2), SimValue(8, 1, 3)]
    ops = [SimOp((1, 0), (2,), 1, "aten.mm.default"), SimOp((2,), (3,), 1, "tanh")]
    assert grad_bytes(values, ops, [True, False, True, True]) == {0: W + 8, 1: 16}


def test_a_slice_has_a_gradient_of_its_own_until_its_step() -> None:
    # x -> y = f(x) (32) -> s = y[:2] (a view, 16) -> c = clone(s) (16) -> loss
    values = [SimValue(8, -1, 0), SimValue(32, 0, 1), SimValue(16, 1, 1, True)]
    values += [SimValue(16, 2, 3), SimValue(4, 3, 4)]
    ops = [SimOp((0,), (1,), 1, "f"), SimOp((1,), (2,), 0, "aten.slice.Tensor")]
    ops += [SimOp((2,), (3,), 1, "aten.clone.default"), SimOp((3,), (4,), 1, "sum")]
    floating = [False, True, False, True, True]  # a view is not floating on its own
    # clone hands c's gradient on to s; slice's formula allocates y's size at its step
    assert grad_bytes(values, ops, floating, passthrough=[2]) == {0: 32, 1: 48, 2: 16, 3: 20}


def test_split_outputs_have_gradients_of_their_own_until_the_split() -> None:
    # x -> y = f(x) (32) -> a, b = split(y) (16 each) -> u = g(a) at step 2, v = h(b, u)
    # at step 3: at step 3 the gradients of v and of b and u, not y's whole buffer
    values = [SimValue(8, -1, 0), SimValue(32, 0, 1), SimValue(16, 1, 1, True)]
    values += [SimValue(16, 1, 1, True), SimValue(16, 2, 4), SimValue(16, 3, 5)]
    ops = [SimOp((0,), (1,), 1, "f"), SimOp((1,), (2, 3), 0, "aten.split.Tensor")]
    ops += [SimOp((2,), (4,), 1, "g"), SimOp((3, 4), (5,), 1, "h")]
    floating = [False, True, False, False, True, True]
    assert grad_bytes(values, ops, floating) == {0: 32, 1: 32 + 32, 2: 16 + 16 + 16, 3: 48}


def _backward_rise(fn: object) -> int:
    """Highest rise of allocated bytes in backward of one step of ``fn`` (a loss)."""

    def step() -> None:
        fn().backward()  # type: ignore[operator]

    timeline = measure(step).timeline
    start = next(k for k, p in enumerate(timeline) if p.phase != "forward")
    base = timeline[start - 1].allocated_bytes if start else 0
    return max(p.allocated_bytes for p in timeline[start:]) - base


def test_autograd_sums_a_tied_weight_as_the_model_says() -> None:
    # The measured fact the rule follows: a tied embedding and head hold three weight-sized
    # buffers at the embedding's step when the head reads the weight through ``t`` (F.linear),
    # two when it reads the weight itself (contiguous gradient, summed in place).
    torch.manual_seed(0)
    weight = torch.randn(1024, 32, requires_grad=True)
    weight.grad = torch.zeros_like(weight)
    ids = torch.randint(0, 1024, (2, 4))
    size = weight.nbytes
    via_t = _backward_rise(lambda: F.linear(F.embedding(ids, weight).tanh(), weight).sum())
    x = torch.randn(8, 1024)
    direct = _backward_rise(lambda: F.embedding(ids, weight).tanh().sum() + (x @ weight).sum())
    assert abs(via_t - 3 * size) < size // 4, via_t
    assert abs(direct - 2 * size) < size // 4, direct
