"""Experts' weights read through a transpose by ``_grouped_mm`` (Mixtral's expert MLPs) in
the liveness simulator: Note [Parameters' gradients in backward] rule 2.

A parameter whose ``.grad`` is ``None`` keeps the first gradient it receives when that
gradient has the parameter's strides, and copies it otherwise. Experts' weights stored as
``(experts, out, in)`` reach ``_grouped_mm`` through ``transpose(-2, -1)``; the op's
formula gives the transposed operand its gradient in the operand's own layout (as
``mm``'s does, unlike ``bmm``'s), so transposing it back gives the parameter's strides and
nothing is copied. Counting a copy put the zoo's Mixtral 0.5-2.6 MB (1-5%) above its measured
backward peak at every ``memory_budget`` point: one weight's bytes at each expert
projection's step. The op's behaviour is measured with its workspace (Note [Measuring op
workspaces] rule 1), so the layout comes from the backend, not from a list of op names.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_liveness import predicted_peak, run_region
from torch import nn

import ckpt_graph as cg
from ckpt_graph.planner.param_grads import param_grads
from ckpt_graph.planner.sim_graph import SimOp, SimValue
from ckpt_graph.planner.workspaces import measure_workspaces

pytestmark = pytest.mark.usefixtures("one_thread")


class Experts(nn.Module):
    """Top-1 routed experts, tokens sorted by expert and multiplied with ``_grouped_mm``,
    scaled by their routing weight (Mixtral's layout: weights ``(experts, out, in)`` read
    through a transpose)."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, hidden, dim) * 0.05)
        self.down = nn.Parameter(torch.randn(experts, dim, hidden) * 0.05)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, -2)
        weight, expert = self.router(tokens).softmax(-1).max(-1)
        order = expert.argsort()
        counts = torch.bincount(expert, minlength=self.experts)
        offs = counts.cumsum(0).to(torch.int32)
        h = tokens[order]
        h = F.gelu(torch._grouped_mm(h, self.up.transpose(-2, -1), offs=offs))
        h = torch._grouped_mm(h, self.down.transpose(-2, -1), offs=offs)
        out = torch.empty_like(h).index_copy(0, order, h) * weight[:, None]
        return x + out.view_as(x)


def _model(blocks: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(Experts(32, 128, 4) for _ in range(blocks)))
    x = torch.randn(2, 16, 32)
    return model, (x,), lambda out: out.pow(2).mean()


def test_grouped_mm_gives_a_transposed_operand_its_own_layout_bmm_does_not() -> None:
    # measured with the op's workspace, from the recorded strides of its operands
    torch.manual_seed(0)
    w = torch.randn(4, 8, 16, requires_grad=True)
    x = torch.randn(12, 16, requires_grad=True)
    offs = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    layouts = {}
    for name, call in (
        ("_grouped_mm", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
        ("bmm", lambda: torch.bmm(x.view(4, 3, 16), w.transpose(-2, -1))),
    ):
        with cg.save_recompute_policy("recompute_all") as region:
            call()
        (node,) = [n for n in region.nodes if n.info.name.startswith(f"aten.{name}")]
        layouts[name] = measure_workspaces(region)[node.index].own_layout
    assert layouts == {"_grouped_mm": True, "bmm": False}


def test_a_transposed_weight_is_copied_unless_its_reader_keeps_the_layout() -> None:
    # w (64 bytes) -> transpose -> op 1 (measured or not); x -> op 1 -> y
    values = [SimValue(64, -1, 0), SimValue(8, -1, 1), SimValue(64, 0, 0, True)]
    values.append(SimValue(8, 1, 3))
    floating, store = [True, False, False, True], [0, 1, 0, 3]
    for head, own_layout, copied in (
        ("aten._grouped_mm.default", {1: True}, False),  # measured: kept
        ("aten.bmm.default", {1: False}, True),  # measured: copied
        ("aten.mm.default", {1: False}, True),  # the measurement wins over the name
        ("aten.mm.default", {}, False),  # not measured: mm and addmm keep it
        ("aten.bmm.default", {}, True),
    ):
        ops = [SimOp((0,), (2,), 0, "aten.transpose.int"), SimOp((1, 2), (3,), 1, head)]
        result = param_grads(values, ops, floating, store, [0], own_layout=own_layout)
        assert result == (({0: 64, 1: 64}, {1: 64}, 64) if copied else ({0: 64}, {}, 64)), (
            head,
            own_layout,
        )


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_predicted_peak_equals_measured_with_experts_grads_none(policy: str) -> None:
    model, inputs, loss = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_region(model, inputs, policy, loss, grads="none")
    # exact: the experts' weights' gradients are made once, at their reader's step
    assert predicted_peak(run) == run.measured
    assert run.graph.param_grad_bytes == sum(p.nbytes for p in model.parameters())
    assert not run.graph.param_grad_made  # nothing copied


def test_gradients_of_the_experts_are_exact() -> None:
    model, inputs, loss = _model()
    for p in model.parameters():
        p.grad = None
    loss(model(*inputs)).backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    for policy in ("recompute_all", cg.policies.memory_budget(0.5, flops_per_byte=2.0)):
        for _ in range(2):  # a budget plans on its first step
            for p in model.parameters():
                p.grad = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with cg.save_recompute_policy(policy):
                    out = model(*inputs)
                loss(out).backward()
        for p, e in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
