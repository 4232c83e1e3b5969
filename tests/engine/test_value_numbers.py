"""Values numbered as they are recorded (Note [Values numbered as recorded]).

Values are numbered as the region records them and the pass graph's rows are made from the
recorded op nodes at region exit (or when first asked); these tests check the graph against
a numbering made afresh from the op nodes, with region inputs seen between op nodes, an op
node the engine adds (a rebased view), and rows asked for while the region still records.
"""

from __future__ import annotations

import torch

import ckpt_graph as cg
from ckpt_graph.engine.passes import pass_graph


def _check_rows(region: cg.Region) -> None:
    g, handles = pass_graph(region)
    for v, h in enumerate(handles):
        assert h.number == v
    assert {id(h) for h in handles} >= {id(h) for h in region.inputs}
    for j, node in enumerate(region.nodes):
        assert tuple(g.inputs[j]) == tuple(h.number for h in node.inputs)
        assert tuple(g.outputs[j]) == tuple(o.number for o in node.outputs if o is not None)
        for o in g.outputs[j]:
            assert g.producer[o] == j
        info = node.info
        single = len(node.outputs) == 1 and node.outputs[0] is not None
        ok = single and info.is_pointwise and not info.writes and not info.is_random
        assert g.transient_ok[j] == ok
    assert list(g.producer) == [h.node_index for h in handles]
    assert list(g.nbytes) == [h.nbytes for h in handles]
    assert list(g.view) == [h.is_view for h in handles]
    assert list(g.has_views) == [h.has_views for h in handles]


def test_rows_match_the_recorded_op_nodes_with_inputs_seen_late() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    w1 = torch.randn(3, 3, requires_grad=True)
    w2 = torch.randn(3, 3, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        a = torch.sin(x @ w1)  # w2 is first seen after two op nodes
        b, c = (a @ w2).split([1, 2], dim=1)
        y = (b * c).relu() + a[:, :1]
    _check_rows(region)
    assert [h.number for h in region.inputs] != list(range(len(region.inputs)))
    y.sum().backward()
    grads = (x.grad, w1.grad, w2.grad)
    x2, w12, w22 = (t.detach().requires_grad_() for t in (x, w1, w2))
    a2 = torch.sin(x2 @ w12)
    b2, c2 = (a2 @ w22).split([1, 2], dim=1)
    ((b2 * c2).relu() + a2[:, :1]).sum().backward()
    for got, want in zip(grads, (x2.grad, w12.grad, w22.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rows_include_an_op_node_the_engine_adds() -> None:
    inp = torch.randn(4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        x = inp * 2
        v = x[0:2]
        x.mul_(3)  # ``v`` changes through its base: the engine records it as a view again
        y = (v * v).sum() + x.sum()
    assert any(n.decided_by == "engine" for n in region.nodes)
    _check_rows(region)
    y.backward()
    inp2 = inp.detach().requires_grad_()
    x2 = inp2 * 2
    v2 = x2[0:2]
    x2.mul_(3)
    ((v2 * v2).sum() + x2.sum()).backward()
    torch.testing.assert_close(inp.grad, inp2.grad, rtol=0, atol=0)


def test_rows_asked_for_while_recording_are_extended_at_exit() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        a = torch.sin(x)
        early, _ = pass_graph(region)  # the planner may ask before the region closes
        assert len(early.inputs) == len(region.nodes) == 1
        y = (a @ w).relu() * a  # ``w`` is first seen after the rows were made
    state = region.pass_state
    # Exit counted live uses from the op node rows alone; the rest waits for a pass.
    assert len(state.node_inputs) == len(region.nodes)
    assert state.numbered[0] == 1
    _check_rows(region)
    y.sum().backward()
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    a2 = torch.sin(x2)
    ((a2 @ w2).relu() * a2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=0)
