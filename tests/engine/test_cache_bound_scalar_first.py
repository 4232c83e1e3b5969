"""The automatic cache bound is not decided by a realize of a few bytes.

Found by ``benchmarks/bench_zoo.py --extra`` on transformers' CLIP: one ``recompute_all``
region measured 33.39 MiB, no checkpointing's peak (torch per block: 12.83 MiB). The first
realize of its backward that caches anything caches the 4-byte ``logit_scale.exp()``, which
the loss's backward reads twice; the automatic bound decided there (Note [Bounded recompute
cache], rule 1) that bounding was not worth it, for the whole pass. Here the same shape in
plain PyTorch: two towers, a learned temperature, a contrastive loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_graph as cg
from ckpt_graph.memory import measure

pytestmark = pytest.mark.usefixtures("one_thread")


class TwoTowers(nn.Module):
    def __init__(self, width: int = 128, layers: int = 6) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(
                *(
                    nn.Sequential(
                        nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
                    )
                    for _ in range(layers)
                )
            )
            for _ in range(2)
        )
        self.log_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.towers[0](a).mean(1), dim=-1)  # pooled: a few pairs' logits
        y = F.normalize(self.towers[1](b).mean(1), dim=-1)
        return (x @ y.t()) * self.log_scale.exp()


def _step(model: TwoTowers, a: torch.Tensor, b: torch.Tensor, policy: str | None) -> None:
    model.zero_grad(set_to_none=True)
    if policy is None:
        logits = model(a, b)
    else:
        with cg.save_recompute_policy(policy):
            logits = model(a, b)
    target = torch.arange(a.shape[0])
    (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)).backward()


def test_recompute_all_bounds_a_pass_whose_first_realize_is_a_scalar() -> None:
    torch.manual_seed(0)
    model = TwoTowers()
    a, b = torch.randn(8, 64, 128), torch.randn(8, 64, 128)
    _step(model, a, b, None)
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    none = measure(lambda: _step(model, a, b, None)).peak_bytes
    bounded = measure(lambda: _step(model, a, b, "recompute_all")).peak_bytes
    # Decided at the scalar, the pass held every recomputed value: no checkpointing's peak.
    assert bounded < 0.6 * none, (bounded, none)
    for n, g in ref.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, rtol=0, atol=0)
