"""The liveness simulator against the engine's real backward on convolutional models.

The drift test of ``test_liveness_drift.py`` on CNNs: ConvNeXt-style blocks (depthwise 7x7
convolution, channels-last LayerNorm, 1x1 MLP) after a BatchNorm stem in plain PyTorch, and
transformers' ConvNeXt and EfficientNet at tiny sizes. What these add to the embedded
workloads: measured convolution workspaces far larger than the values (the depthwise
``convolution_backward``), permute copies around the channels-last norm, and the copies of
BatchNorm's running statistics the region holds (Note [Backward liveness model] rule 3).
Each case compares how often each op node ran and the measured peak (kept bytes at backward
start, copies included, plus the highest rise in backward) with the simulator's prediction.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_liveness import named_policy, predicted_peak, run_region
from torch import nn

from ckpt_graph.compare.zoo import build_workload
from ckpt_graph.planner.from_region import kept_ops_of
from ckpt_graph.planner.liveness import simulate


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)  # channels last for the norm and the MLP
        y = self.fc2(F.gelu(self.fc1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class SmallConvNeXt(nn.Module):
    """A BatchNorm stem, ConvNeXt-style blocks, a pooled linear head."""

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.bn = nn.BatchNorm2d(dim)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(n)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(h.mean((2, 3)))  # type: ignore[no-any-return]


def _plain() -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    y = torch.randint(0, 10, (2,))
    return SmallConvNeXt(16, 3).train(), (x,), lambda out: F.cross_entropy(out, y)


def _zoo(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    pytest.importorskip("transformers")
    layers = 2 if name == "hf-convnext" else 10
    w = build_workload(name, layers=layers, width=8, batch=2, seq_len=32)
    return w.model, w.inputs, w.loss


def _check(model: nn.Module, inputs: tuple[Any, ...], loss: Any, policy: str, limit: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_region(model, inputs, named_policy(policy), loss, cache_limit=limit)
    region = run.region
    sim = simulate(run.graph, kept_ops_of(region))
    assert list(sim.runs) == [n.realized for n in region.nodes]  # the same ops ran, as often
    assert sim.recomputed_ops == region.pass_state.recomputed_ops
    # exact on every case when written (the tiny EfficientNet: 384 bytes above)
    assert abs(predicted_peak(run) - run.measured) <= 0.01 * run.measured, (
        predicted_peak(run),
        run.measured,
    )


@pytest.mark.parametrize("limit", [None, "unbounded", 64 * 1024])
@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls", "budget"])
def test_convnext_blocks_in_plain_pytorch(policy: str, limit: Any) -> None:
    model, inputs, loss = _plain()
    _check(model, inputs, loss, policy, limit)


@pytest.mark.parametrize(
    ("name", "policy"),
    [
        ("hf-convnext", "recompute_all"),
        pytest.param("hf-convnext", "budget", marks=pytest.mark.slow),
        pytest.param("hf-efficientnet", "recompute_all", marks=pytest.mark.slow),
        pytest.param("hf-efficientnet", "budget", marks=pytest.mark.slow),
    ],
)
def test_transformers_cnns_at_tiny_sizes(name: str, policy: str) -> None:
    model, inputs, loss = _zoo(name)
    _check(model, inputs, loss, policy, None)
