"""accelerate: ``accelerator.prepare(model, optimizer)`` with regions trains exactly (CPU)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import ckpt_graph as cg
from ckpt_graph.memory import measure

accelerate = pytest.importorskip("accelerate", reason="needs accelerate")

from .hf_models import batch, build  # noqa: E402


class _Blocks(torch.nn.Module):
    """A residual MLP stack with dropout: regions must replay its random ops exactly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(64),
                torch.nn.Linear(64, 256),
                torch.nn.GELU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(256, 64),
            )
            for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _accelerator() -> Any:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True)


def _train(model: torch.nn.Module, steps: int = 3) -> list[float]:
    accelerator = _accelerator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    losses = []
    torch.manual_seed(2)
    for _ in range(steps):
        x = torch.randn(16, 32, 64, generator=g)
        loss = prepared(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls"])
def test_prepared_wrapped_model_trains_exactly(policy: str) -> None:
    plain = _Blocks()
    model = cg.wrap(
        copy.deepcopy(plain),
        policy=cg.policies.save_matmuls() if policy == "save_matmuls" else policy,
    )
    ref = _train(plain)
    assert _train(model) == ref
    for name, value in _params(plain).items():
        torch.testing.assert_close(_params(model)[name], value, rtol=0, atol=0, msg=name)


def test_prepared_wrapped_model_peak_lower() -> None:
    plain_peak = measure(_train, _Blocks(), 1).peak_bytes
    peak = measure(_train, cg.wrap(_Blocks()), 1).peak_bytes
    assert peak < 0.8 * plain_peak, (peak, plain_peak)


def test_prepared_hf_model_with_enable_trains_exactly() -> None:
    pytest.importorskip("transformers")
    from ckpt_graph.integrations import transformers as cg_hf

    results = []
    for use_cg in (False, True):
        model = build("llama", layers=2)
        if use_cg:
            cg_hf.enable(model)
        accelerator = _accelerator()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        for seed in (1, 2):
            ids = batch(seed)
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
        results.append(_params(accelerator.unwrap_model(model)))
        assert cg_hf.is_enabled(accelerator.unwrap_model(model)) == use_cg
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=0, atol=0, msg=name)
