"""``record_node`` sets the fields of the op nodes and handles it makes inline (Note [Objects
made per op], rule 4): every slot is set, and to what the constructors would set."""

from __future__ import annotations

import torch

import ckpt_graph as cg
from ckpt_graph.engine.graph import Handle, OpNode


def _slots(obj: object) -> dict[str, object]:
    names = [s for s in type(obj).__slots__ if s != "__weakref__"]
    missing = [s for s in names if not hasattr(obj, s)]
    assert not missing, f"{type(obj).__name__} slots never set: {missing}"
    return {s: getattr(obj, s) for s in names}


def test_recorded_node_and_handle_match_their_constructors() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with cg.save_recompute_policy(policy="recompute_all") as region:
        y = torch.sin(x)
        z = y * 2.0
    node = region.nodes[-1]
    h = node.outputs[0]
    assert isinstance(h, Handle)
    fields = _slots(node)
    built = OpNode(
        node.index,
        node.op,
        node.info,
        node.args,
        node.kwargs,
        node.inputs,
        node.outputs,
        node.decision,
        node.decided_by,
        node.module_path,
        node.module_call,
        node.rng,
        node.out_is_tuple,
    )
    assert fields == _slots(built)
    assert not node.out_is_tuple and node.flops == -1 and node.pass_id == -1
    made = Handle(z, h.node_index, h.output_index, h.number)
    made.shape = h.shape  # the region shares equal shapes (Note [One recording path], rule 3)
    # Fields the region set after making the handle (uses, saved tensors) differ; the rest
    # are the constructor's.
    later = {"forward_uses", "saved_refs", "stride", "device", "storage", "storage_offset"}
    theirs = {k: v for k, v in _slots(made).items() if k not in later}
    ours = {k: v for k, v in _slots(h).items() if k not in later}
    assert ours == theirs
    assert h() is z and h.number == len(region.pass_state.handles) - 1
    z.sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * torch.cos(x), rtol=0, atol=0)
