"""Note [Errors raised by a recomputed op]: an op that raises while it is recomputed in
backward raises its own exception type, with a note naming the op."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ckpt_graph as cg

# Runs of the op below, and from which run on it raises (0: never).
RUNS = {"count": 0, "fail_from": 0}


@torch.library.custom_op("ckpt_graph_test::oom_on_rerun", mutates_args=())
def oom_on_rerun(x: torch.Tensor) -> torch.Tensor:
    """``sin``, which raises ``torch.OutOfMemoryError`` from run ``RUNS["fail_from"]`` on."""
    RUNS["count"] += 1
    if RUNS["fail_from"] and RUNS["count"] >= RUNS["fail_from"]:
        raise torch.OutOfMemoryError("simulated: tried to allocate 2.00 GiB")
    return x.sin()


@oom_on_rerun.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad * x.cos()


oom_on_rerun.register_autograd(_backward, setup_context=_setup)


class ReadsTwice(torch.autograd.Function):
    """``2 * a``, whose backward reads its saved tensor twice (a second read in one pass)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return grad * 2 + 0 * (a + again)


@pytest.fixture(autouse=True)
def _reset_runs() -> None:
    RUNS.update(count=0, fail_from=0)


def _note(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


def test_out_of_memory_while_recomputing_keeps_its_type() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all"):
        loss = oom_on_rerun(x).exp().sum()  # exp saves its result: recomputed from the op
    RUNS["fail_from"] = 2  # the forward ran it once; its recompute raises
    with pytest.raises(torch.OutOfMemoryError, match="simulated: tried to allocate") as info:
        loss.backward()
    assert not isinstance(info.value, cg.CkptGraphError)
    assert (
        "ckpt_graph: raised while recomputing op #0 ckpt_graph_test.oom_on_rerun.default "
        "(position 0 of the region's forward) in backward" in _note(info.value)
    )
    assert "tag_with_policy(t, True)" in _note(info.value)


def test_out_of_memory_on_a_second_read_keeps_its_type() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all"):
        loss = ReadsTwice.apply(oom_on_rerun(x)).sum()
    RUNS["fail_from"] = 3  # the first read recomputes it; the second read's rerun raises
    with pytest.raises(torch.OutOfMemoryError, match="simulated") as info:
        loss.backward()
    assert RUNS["count"] == 3
    assert "raised while recomputing op #0 ckpt_graph_test.oom_on_rerun.default" in _note(
        info.value
    )


def test_retry_after_out_of_memory_gives_the_eager_gradient() -> None:
    """A loop that catches the error and runs backward again once memory is back."""
    x = torch.randn(3, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all"):
        loss = oom_on_rerun(x).exp().sum()
    RUNS["fail_from"] = 2
    with pytest.raises(torch.OutOfMemoryError):
        loss.backward(retain_graph=True)
    RUNS["fail_from"] = 0
    loss.backward()
    torch.testing.assert_close(x.grad, (x.sin().exp() * x.cos()).detach(), rtol=0, atol=0)
