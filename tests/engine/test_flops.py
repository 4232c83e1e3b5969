"""One FLOP estimator: ``engine.flops``.

The policy context (``ctx.flops``, from the op's real tensors while it is recorded), the
planner's recompute costs and the analysis (summaries, exports) all read FLOPs through
``ckpt_graph.engine.flops``; these tests check that they are one function and that it gives
the formulas' figures for the ops that cost most.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

import ckpt_graph
from ckpt_graph.analysis import export, values
from ckpt_graph.engine import decisions, flops
from ckpt_graph.engine.graph import Handle, OpNode
from ckpt_graph.engine.op_info import op_info
from ckpt_graph.planner import cost_model

aten = torch.ops.aten


def test_planner_analysis_and_policy_context_share_one_estimator() -> None:
    assert cost_model.node_flops is flops.node_flops
    assert values.node_flops is flops.node_flops
    assert export.node_flops is flops.node_flops
    assert decisions.estimate_flops is flops.estimate_flops


def _model(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    bx: torch.Tensor,
    by: torch.Tensor,
    img: torch.Tensor,
    cw: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
) -> torch.Tensor:
    y = x @ w  # mm
    y = torch.addmm(b, x, w)
    z = torch.bmm(bx, by)
    c = F.conv2d(img, cw, padding=1)
    a = F.scaled_dot_product_attention(q, k, k)
    e = (y.sin() * 2 + y).relu()  # elementwise: no formula
    return y.sum() + z.sum() + c.sum() + a.sum() + e.sum()


def test_node_flops_agrees_with_the_policy_context_and_the_formulas() -> None:
    """For matmul, addmm, bmm, conv, SDPA and elementwise ops, the FLOPs a policy reads
    while the op is recorded (real tensors) equal those of the recorded op node (shape-only
    stand-ins) and the textbook counts."""
    seen: list[tuple[str, int]] = []

    def log_flops(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        seen.append((ctx.op_name, ctx.flops))

    x, w, b = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32)
    bx, by = torch.randn(3, 4, 6), torch.randn(3, 6, 5)
    img, cw = torch.randn(2, 3, 9, 9), torch.randn(5, 3, 3, 3)
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 4, 12, 8)
    inputs = [t.requires_grad_() for t in (x, w, b, bx, by, img, cw, q, k)]
    with ckpt_graph.save_recompute_policy(log_flops) as region:
        out = _model(*inputs)
    nodes = region.nodes
    assert len(seen) == len(nodes)
    by_op: dict[str, int] = {}
    for node, (name, at_record) in zip(nodes, seen, strict=True):
        node.flops = -1  # not cached yet
        assert flops.node_flops(node) == at_record, name
        assert node.flops == at_record  # cached on the node
        by_op.setdefault(node.op.overloadpacket.__name__, at_record)
    assert by_op["mm"] == 2 * 8 * 16 * 32
    assert by_op["addmm"] == 2 * 8 * 16 * 32
    assert by_op["bmm"] == 2 * 3 * 4 * 6 * 5
    assert by_op["convolution"] == 2 * (2 * 5 * 9 * 9) * (3 * 3 * 3)
    sdpa = [n for n in by_op if "scaled_dot_product" in n]
    assert len(sdpa) == 1
    assert by_op[sdpa[0]] == sdpa_flop_count(q.shape, k.shape, k.shape) > 0
    for name in ("sin", "mul", "add", "relu", "sum"):
        assert by_op[name] == 0
    out.backward()


def test_recompute_costs_use_the_node_estimate() -> None:
    """The planner's recompute cost of an op with a formula is its FLOPs; of one without, its
    bytes moved times ``flops_per_byte`` (pinned here, see Note [Recompute cost model])."""
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32)
    with ckpt_graph.save_recompute_policy("recompute_all") as region:
        out = (x @ w).sin().sum()
    costs = cost_model.recorded_costs(region, range(len(region.nodes)), flops_per_byte=4.0)
    mm, sin = region.nodes[0], region.nodes[1]
    assert mm.op is aten.mm.default and sin.op is aten.sin.default
    assert costs[0] == flops.node_flops(mm) == 2 * 8 * 16 * 32
    assert costs[1] == cost_model.op_cost(0, 2 * 8 * 32 * 4, 4.0)
    out.backward()


def test_raw_formulas_get_tensor_stand_ins() -> None:
    """A few attention formulas read tensor attributes (registered with ``get_raw``): the
    node estimate gives them meta tensors, not bare shapes (on which they raise, which read
    as 0 FLOPs). The op node is built by hand: these are CUDA kernels."""
    op = aten._efficient_attention_forward.default
    q = torch.empty(2, 10, 4, 8)
    h = Handle(q, -1, 0)
    node = OpNode(
        0, op, op_info(op), (h, h, h, None, None, None, None, None, 0.0, 0, False), {}, (h,)
    )
    node.outputs = (Handle(q, 0, 0), None, None, None, None, None)
    node.out_is_tuple = True
    meta = torch.empty(2, 10, 4, 8, device="meta")
    want = flop_registry[op.overloadpacket](
        meta, meta, meta, None, None, None, None, None, 0.0, 0, False, out_val=None
    )
    assert flops.node_flops(node) == want > 0
    with pytest.raises(AttributeError):  # what a shape-only estimate ran into
        flop_registry[op.overloadpacket](
            q.shape, q.shape, q.shape, None, None, None, None, None, 0.0, 0, False, out_val=None
        )


def test_node_flops_inside_a_recording_region_records_nothing() -> None:
    """The meta stand-ins are made with the dispatch modes disabled, so asking for FLOPs while
    a region records (a policy reading ``region.summary()``) adds no op node."""
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32)
    with ckpt_graph.save_recompute_policy("recompute_all") as region:
        y = x @ w
        before = len(region.nodes)
        node = region.nodes[0]
        node.flops = -1
        assert flops.node_flops(node) == 2 * 8 * 16 * 32
        assert len(region.nodes) == before
        out = y.sum()
    out.backward()
