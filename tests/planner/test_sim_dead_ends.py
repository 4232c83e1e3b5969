"""Values backward never reaches (Note [Values backward never reaches]).

An MoE-style router read only through ``argmax``, the indices of ``topk`` and a comparison
gets no gradient from autograd: the simulator gives it no gradient buffer, no ``.grad`` in
the step's parameters' gradients, and drops the saves of the dead end's ops. Checked
against the measured peak with ``.grad`` set to ``None`` at each step, and the gradients
against plain eager, bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_liveness import predicted_peak, run_region
from torch import nn


class Router(nn.Module):
    """Experts (all run, one output picked: deterministic gradients, unlike indexing the
    weights, whose backward accumulates in parallel) picked by ``argmax`` of a gate and a bias picked by ``topk`` indices of a
    second gate; with ``use_values`` the ``topk`` values also scale the output, so that
    second gate gets a gradient."""

    def __init__(self, dim: int = 64, experts: int = 4, use_values: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.gate2 = nn.Parameter(torch.randn(dim, 256) * 0.02)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) * 0.02)
        self.use_values = use_values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.gate(x).argmax(-1)
        values, top = torch.topk(x @ self.gate2, 2, dim=-1)
        every = torch.stack([x @ w for w in self.experts], 1)  # (n, experts, dim)
        y = every.gather(1, idx[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(1)
        y = torch.tanh(y) + (top.float().mean(-1, keepdim=True) > 100).float()
        return y * values.sum(-1, keepdim=True) if self.use_values else y


def _eager_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("use_values", [False, True], ids=["dead-end", "values-used"])
@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_a_router_read_only_through_indices_gets_no_gradient(policy: str, use_values: bool) -> None:
    torch.manual_seed(0)
    model = Router(use_values=use_values)
    x = torch.randn(64, 64)
    expected = _eager_grads(model, x)
    run = run_region(model, (x,), policy, grads="none")
    # autograd: the router read through argmax never gets a gradient; the second gate only
    # when the topk values reach the loss
    assert model.gate.weight.grad is None and expected["gate.weight"] is None
    assert (model.gate2.grad is None) == (not use_values)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0)
    grads = model.experts.nbytes + (model.gate2.nbytes if use_values else 0)
    assert run.graph.param_grad_bytes == grads
    # exact when written; before the Note the two gates' 65 KB of gradients were in the
    # step's parameters' gradients, and the kept topk indices above the measured peak
    assert predicted_peak(run) == run.measured, (predicted_peak(run), run.measured)
