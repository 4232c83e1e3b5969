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


def _torch_checkpoint_grad(replace: str) -> torch.Tensor:
    x = _leaf()
    y = torch.utils.checkpoint.checkpoint(lambda t: t.sin().exp(), x, use_reentrant=False)
    _replace_data(y, replace)
    y.sum().backward()
    assert x.grad is not None
    return x.grad


def _replace_data(y: torch.Tensor, replace: str) -> None:
    """Change what ``y`` holds without an in-place op: its version stays as it was."""
    if replace == "new_storage":
        y.data = torch.zeros_like(y)
    else:  # the same storage, read with other strides (a transpose of the (5, 4) layout)
        y.data = y.data.as_strided(y.shape, (1, y.shape[0]))


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("replace", ["new_storage", "same_storage_other_strides"])
def test_a_held_value_whose_data_was_replaced_is_recomputed(replace: str, debug: bool) -> None:
    """``y.data = ...`` keeps the object and its version; eager's saved output keeps the
    storage the forward produced, so the region recomputes instead of reading ``y``."""
    x = _leaf()
    with cg.save_recompute_policy("recompute_all", debug=debug) as region:
        y = x.sin().exp()
    version = y._version
    _replace_data(y, replace)
    assert y._version == version
    y.sum().backward()
    torch.testing.assert_close(x.grad, _eager_grad(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, _torch_checkpoint_grad(replace), rtol=0, atol=0)
    assert _exp_runs(region) == 1
