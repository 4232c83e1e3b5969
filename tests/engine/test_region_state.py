"""The region's state through its owners and its public view, across its lifetime."""

from __future__ import annotations

import gc

import torch
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg


def _forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).sin().exp().sum()


def test_open_closed_and_released_follow_the_block_and_backward() -> None:
    x = torch.randn(4, 4)
    w = torch.randn(4, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        assert region.is_open and not region.released
        assert region.recording.on
        loss = _forward(x, w)
    assert not region.is_open and not region.released
    assert not region.recording.on
    # autograd holds one packed object per save until backward lets go of them
    assert region.saved_log.live_packs == len(region.saved_log) == len(region.saved) > 0
    assert [h for _, h in region.saved] == region.saved_log.handles
    loss.backward()
    assert region.released and region.saved_log.live_packs == 0
    assert all(o is None or o.value is None for n in region.nodes for o in n.outputs)
    assert all(h.value is None for h in region.inputs)


def test_dropping_the_graph_releases_the_region() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        loss = _forward(torch.randn(4, 4), w)
    assert not region.released
    del loss
    gc.collect()  # no cycle is involved; this only makes the test independent of that
    assert region.released


def test_closing_keeps_only_what_backward_needs_of_the_recording() -> None:
    x = torch.randn(4, 4)
    w = torch.randn(4, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        y = x @ w
        y.mul_(2)  # an in-place op builds the storage index and a write history
        assert region.recording.by_storage is not None and region.recording.storages
        loss = y.sum()
    state = region.recording
    assert state.by_storage is None and not state.storages and not state.shapes
    assert not state.unsettled and not region.saved_log.strides
    assert region.policy_stack.ctx is None
    assert region.lookup(y) is not None  # ids stay: the user may still ask about tensors
    loss.backward()
    w_ref = w.detach().clone().requires_grad_()
    (x @ w_ref).mul_(2).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=0)


def test_policy_stack_follows_nested_blocks() -> None:
    def prefer_save(ctx: object, out: object, op: object, *a: object, **k: object) -> bool:
        return True

    with cg.save_recompute_policy("recompute_all") as region:
        stack = region.policy_stack
        assert stack.constant is CheckpointPolicy.PREFER_RECOMPUTE
        assert stack.constant_by == stack.names[0] and stack.ctx is not None
        with cg.save_recompute_policy(prefer_save):
            assert len(region.policies) == 2 and region.policies[1] is prefer_save
            assert stack.constant is None and stack.names[0] == "recompute_all"
        assert stack.constant is CheckpointPolicy.PREFER_RECOMPUTE
    assert region.policies == () and stack.constant is None and stack.names == []
