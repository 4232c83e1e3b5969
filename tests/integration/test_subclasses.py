"""Tensor subclasses inside a region: a wrapper subclass (TwoTensor) and DTensor.

Gradients are compared bitwise (float64) with a run without checkpointing, and the region must
really recompute (not keep everything) under ``recompute_all``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ckpt_graph as cg

POLICIES = ["recompute_all", "must_save_all"]


def _run(fn: Callable[[], torch.Tensor], policy: str | None) -> Any:
    if policy is None:
        fn().backward()
        return None
    with cg.save_recompute_policy(policy) as region:
        y = fn()
    y.backward()
    return region


@pytest.mark.parametrize("policy", POLICIES)
def test_wrapper_subclass_two_tensor(policy: str) -> None:
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    gen = torch.Generator().manual_seed(0)
    a, b, w0 = (torch.randn(4, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    grads = []
    for p in (None, policy):
        x = two_tensor.TwoTensor(a.clone(), b.clone()).requires_grad_()
        w = w0.clone().requires_grad_()
        region = _run(lambda: ((x @ w).sin() * 2).exp().sum(), p)  # noqa: B023
        grads.append((x.grad, w.grad))
        if p == "recompute_all":
            assert region.pass_state.recomputed_ops > 0
    (gx, gw), (x_grad, w_grad) = grads
    assert type(x_grad).__name__ == "TwoTensor"
    torch.testing.assert_close(x_grad.a, gx.a, rtol=0, atol=0)
    torch.testing.assert_close(x_grad.b, gx.b, rtol=0, atol=0)
    torch.testing.assert_close(w_grad, gw, rtol=0, atol=0)


@pytest.fixture
def mesh() -> Iterator[Any]:
    """A one-rank CPU device mesh (gloo, in-process store)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("policy", POLICIES)
def test_dtensor(mesh: Any, policy: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 8, dtype=torch.float64, generator=gen)
    w0 = torch.randn(8, 8, dtype=torch.float64, generator=gen)
    grads = []
    for p in (None, policy):
        x = distribute_tensor(x0, mesh, [Replicate()]).requires_grad_()
        w = distribute_tensor(w0, mesh, [Shard(0)]).requires_grad_()
        region = _run(lambda: F.gelu(F.linear(x, w)).sin().sum(), p)  # noqa: B023
        grads.append((x.grad.full_tensor(), w.grad.full_tensor()))
        if p == "recompute_all":
            assert region.pass_state.recomputed_ops > 0
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
