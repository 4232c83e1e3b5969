"""The planner's graph of a recorded region: aliases and in-place writes to kept values."""

from __future__ import annotations

import torch

import ckpt_graph as cg
from ckpt_graph.engine.region import Region
from ckpt_graph.planner.from_region import from_region
from ckpt_graph.policies import save_ops

aten = torch.ops.aten


def test_unsafe_view_shares_its_input_storage_and_costs_nothing() -> None:
    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        y = torch.nn.functional.linear(x, w).relu()  # mm on the flattened input, reshaped back
    y.sum().backward()
    g = from_region(region)
    names = [op.name for op in g.ops]
    assert "aten._unsafe_view.default" in names, names
    j = names.index("aten._unsafe_view.default")
    (out,) = g.ops[j].outputs
    (src,) = (i for i in g.ops[j].inputs if g.values[i].producer >= 0)
    assert g.values[out].storage == g.values[src].storage
    assert g.values[g.values[src].storage].producer == names.index("aten.mm.default")
    assert g.ops[j].cost == 0


def _dropout_region(policy: object) -> Region:
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    with cg.save_recompute_policy(policy) as region:  # type: ignore[arg-type]
        y = torch.nn.functional.dropout(x.sin(), 0.5).cos()
    y.sum().backward()
    return region


def test_in_place_writes_to_a_kept_value_follow_the_plan_when_it_decides() -> None:
    region = _dropout_region(save_ops(aten.empty_like))
    nodes = region.nodes
    names = [n.op.name() for n in nodes]
    writes = [
        j for j, n in enumerate(names) if n in ("aten::bernoulli_.float", "aten::div_.Scalar")
    ]
    assert writes, names  # CPU dropout: empty_like, bernoulli_ and div_ on the mask
    decided = from_region(region, free_ops=range(len(nodes)))
    assert not decided.fixed  # keeping the mask is the plan's choice: nothing is fixed
    undecided = from_region(region)
    fixed_ops = {undecided.values[v].producer for v in undecided.fixed}
    assert set(writes) <= fixed_ops  # the forward's decisions stand when the plan has none
    for v in undecided.fixed:  # every version of the mask lives in one storage
        assert undecided.values[v].storage == undecided.values[min(undecided.fixed)].storage
