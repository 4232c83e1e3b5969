"""Keeping every value costs no more memory than no checkpointing.

Found by ``benchmarks/bench_zoo.py`` (BENCHMARKS.md, "The third-party zoo"): on
transformers' ResNet (8 layers, width 16, batch 8, 128 x 128 images) ``memory_budget(1.0)``
kept every op ("the all plan", 0 FLOPs recomputed) and measured a step peak of 20.14 MiB
against 15.55 MiB without checkpointing (1.30x), with no warning; ``"must_save_all"`` the
same. Conv -> BatchNorm -> ReLU (not in place) reproduced it in plain PyTorch: autograd
saves the convolution's output for the norm and the ReLU's output for itself, never the
norm's output, yet the region held that too until its exit. Kept values now live no longer
than what reads them (Note [Kept values live no longer than in eager]), and BatchNorm's
running statistics are no longer copied for the saved tensors that refer to them (Note
[Silent writes]): the convolutional models here peak at exactly no checkpointing's level,
with gradients bitwise those of eager. The documented margin: a random op (dropout, here in
the transformer blocks) whose outputs are kept holds its generator state (5 KiB on CPU)
while its kept outputs may still be read, so that a kept value changed after the region
can be recomputed (Note [Kept values changed after the region]); the test allows exactly
the states the region holds at its exit. ``flops_per_byte`` is pinned.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import TransformerBlock
from torch import nn

import ckpt_graph as cg
from ckpt_graph.memory import measure
from ckpt_graph.planner.memory_budget import memory_budget

FPB = 4.0
POLICIES = ["memory_budget(1.0)", "must_save_all"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _conv_bn_relu(inplace: bool) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [
            nn.Conv2d(16, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=inplace),
        ]
    return nn.Sequential(*layers), (torch.randn(8, 16, 32, 32),), torch.sum


def _hf_resnet() -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers' ResNet needs the 'transformers' package")
    from ckpt_graph.compare.zoo import build_workload

    w = build_workload("hf-resnet", layers=4, width=8, batch=4, seq_len=32)
    return w.model, w.inputs, w.loss


def _transformer_block() -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    torch.manual_seed(0)
    block = nn.Sequential(*(TransformerBlock(64, 4, 0.1) for _ in range(2)))
    return block, (torch.randn(4, 32, 64),), lambda y: (y * y).mean()


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...], Any]]] = {
    "conv-bn-relu": lambda: _conv_bn_relu(False),
    "conv-bn-relu_": lambda: _conv_bn_relu(True),
    "hf-resnet": _hf_resnet,
    "transformer-block": _transformer_block,
}


def _step(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], loss: Any, policy: object, held: list[int]
) -> None:
    """One step; appends to ``held`` the bytes of generator states the region holds into
    backward (see the module docstring)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)  # the same dropout masks in every step
    if policy is None:
        out = model(*inputs)
    else:
        with cg.save_recompute_policy(policy) as region:  # type: ignore[arg-type]
            out = model(*inputs)
        held.append(sum(n.rng[1].nbytes for n in region.nodes if n.rng is not None))
    loss(out).backward()


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_keeping_everything_peaks_no_higher_than_no_checkpointing(
    model_name: str, name: str
) -> None:
    model, inputs, loss = MODELS[model_name]()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain = measure(_step, model, inputs, loss, None, []).peak_bytes
    ref = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    ref_buffers = [b.clone() for b in model.buffers()]
    policy = memory_budget(1.0, flops_per_byte=FPB) if name != "must_save_all" else name
    for _ in range(2):  # the first step decides by the heuristic, the second follows the plan
        model.load_state_dict(state)
        _step(model, inputs, loss, policy, [])
    model.load_state_dict(state)
    held: list[int] = []
    peak = measure(_step, model, inputs, loss, policy, held).peak_bytes
    for p, q in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, q, rtol=0, atol=0)
    for b, c in zip(model.buffers(), ref_buffers, strict=True):  # running stats updated once
        torch.testing.assert_close(b, c, rtol=0, atol=0)
    assert peak <= plain + held[0], (peak / 2**20, plain / 2**20, held)
    if not model_name.startswith("transformer"):
        assert held == [0]  # no random op: exactly at or below no checkpointing
    if isinstance(policy, str):
        return
    report = policy.report()
    assert report is not None and "all plan" in str(report).splitlines()[0]
