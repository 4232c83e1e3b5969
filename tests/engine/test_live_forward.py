"""Note [Live forward tensors]: a saved value the program still holds is unpacked as it is."""

from __future__ import annotations

import pytest
import torch

import ckpt_graph as cg


def _leaf(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(4, 5, requires_grad=True)


def _exp_runs(region: cg.Region) -> int:
    (node,) = [n for n in region.nodes if n.op is torch.ops.aten.exp.default]
    return node.realized


def _eager_grad(create_graph: bool = False) -> torch.Tensor:
    x = _leaf()
    y = x.sin().exp()  # exp saves its result
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=create_graph)
    if create_graph:
        (g,) = torch.autograd.grad(g.sum(), x)
    return g


def test_a_held_value_is_not_recomputed() -> None:
    x = _leaf()
    with cg.save_recompute_policy("recompute_all") as region:
        y = x.sin().exp()
    y.sum().backward()  # the program holds y
    assert _exp_runs(region) == 0
    torch.testing.assert_close(x.grad, _eager_grad(), rtol=0, atol=0)


def test_a_dropped_value_is_recomputed() -> None:
    x = _leaf()
    with cg.save_recompute_policy("recompute_all") as region:
        loss = x.sin().exp().sum()
    loss.backward()
    assert _exp_runs(region) == 1
    torch.testing.assert_close(x.grad, _eager_grad(), rtol=0, atol=0)


def test_a_held_value_written_after_the_region_raises_as_in_eager() -> None:
    x = _leaf()
    y = x.sin().exp()
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    x = _leaf()
    with cg.save_recompute_policy("recompute_all"):
        y = x.sin().exp()
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("mode", ["retain_graph", "create_graph"])
def test_a_held_value_in_other_backward_modes(mode: str) -> None:
    x = _leaf()
    with cg.save_recompute_policy("recompute_all") as region:
        y = x.sin().exp()
    if mode == "retain_graph":
        y.sum().backward(retain_graph=True)
        x.grad = None
        y.sum().backward()
        torch.testing.assert_close(x.grad, _eager_grad(), rtol=0, atol=0)
    else:
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        torch.testing.assert_close(gg, _eager_grad(create_graph=True), rtol=0, atol=0)
    assert _exp_runs(region) == 0
