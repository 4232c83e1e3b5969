"""One ``memory_budget`` for a whole HF training step with a region per layer.

Tiny GPT-2 and Llama (6 layers, random init) with ``integrations.transformers.enable``: the
regions of a step are planned jointly (Note [Step budget across regions]). Gradients are
accumulated into zeroed buffers, so that a step's peak is its activation memory.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ckpt_graph import policies
from ckpt_graph.memory import measure

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (pip install transformers)"
)

from ckpt_graph.integrations import transformers as cg_hf  # noqa: E402

from .hf_models import batch, build, loss  # noqa: E402

LAYERS = 6


def _step(model: Any, ids: torch.Tensor) -> None:
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    loss(model, ids).backward()


def _grads(model: Any) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _flops(model: Any, ids: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        _step(model, ids)
    return counter.get_total_flops()


@functools.cache
def _plain(kind: str) -> tuple[int, list[torch.Tensor], int]:
    """Peak bytes, gradients and FLOPs of a step without checkpointing."""
    model, ids = build(kind, layers=LAYERS), batch()
    _step(model, ids)  # allocates the gradient buffers
    peak = measure(_step, model, ids).peak_bytes
    return peak, _grads(model), _flops(model, ids)


def _quiet_step(model: Any, ids: torch.Tensor) -> tuple[int, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peak = measure(_step, model, ids).peak_bytes
    return peak, [str(w.message) for w in caught if "ckpt_graph" in str(w.message)]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7])
def test_step_peak_meets_the_fraction_of_the_plain_step(kind: str, fraction: float) -> None:
    plain, ref, _ = _plain(kind)
    model, ids = build(kind, layers=LAYERS), batch()
    policy = policies.memory_budget(fraction)
    cg_hf.enable(model, policy)
    _quiet_step(model, ids)  # first step: online heuristic, then the step is planned
    for _ in range(2):
        peak, warned = _quiet_step(model, ids)
        assert warned == []
        torch.testing.assert_close(_grads(model), ref, rtol=0, atol=0)
        assert peak <= (fraction + 0.1) * plain, (peak / plain, fraction)
    step = policy.step_report()
    assert step is not None and step.regions == LAYERS and step.graphs == 1
    assert step.feasible and step.predicted_peak_bytes <= step.budget_bytes


_TAIL = (
    "step budget at HF's peak on GPT-2: memory outside the regions (ln_f, lm_head, loss) is "
    "not modelled; the last layer keeps everything and coexists with it: 1.24x HF's peak"
)


@pytest.mark.parametrize(
    "kind", [pytest.param("gpt2", marks=pytest.mark.xfail(strict=True, reason=_TAIL)), "llama"]
)
def test_at_hf_checkpointing_peak_recomputes_less(kind: str) -> None:
    plain, ref, plain_flops = _plain(kind)
    model, ids = build(kind, layers=LAYERS), batch()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _step(model, ids)
    hf_peak = measure(_step, model, ids).peak_bytes
    torch.testing.assert_close(_grads(model), ref, rtol=0, atol=0)
    hf_recompute = _flops(model, ids) - plain_flops
    model.gradient_checkpointing_disable()
    # The step's memory besides the activations the planner budgets (logits, embeddings):
    # the plain step's peak minus the activation bytes of its regions.
    probe = policies.memory_budget(1.0)
    cg_hf.enable(model, probe)
    _step(model, ids)
    step = probe.step_report()
    assert step is not None
    others = plain - step.baseline_bytes
    policy = policies.memory_budget(hf_peak - others)
    cg_hf.enable(model, policy)
    _quiet_step(model, ids)
    peak, warned = _quiet_step(model, ids)
    assert warned == []
    torch.testing.assert_close(_grads(model), ref, rtol=0, atol=0)
    recompute = _flops(model, ids) - plain_flops
    assert peak <= hf_peak, peak / hf_peak
    assert 0 < recompute < hf_recompute, (recompute, hf_recompute)
