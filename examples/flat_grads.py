"""Flat gradient buffers with checkpointed layers, micro-batches and zero-copy gradient writes.

Trains a small residual MLP whose blocks run inside a ckpt_graph region, with every gradient
living in one flat buffer (``ckpt_graph.grads.FlatGrads``), and checks at each step that:
- every ``.grad`` is still a view of the buffer, at the same address as in the first step;
- the parameters equal those of the same training run without the buffer, bit for bit.
Then shows one backward where each Linear writes its weight gradient straight into the buffer
(``ckpt_graph.grads.linear``), adopted by autograd without a copy.

Run: python examples/flat_grads.py
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import ckpt_graph as cg
from ckpt_graph.grads import FlatGrads, linear


class Block(nn.Module):
    def __init__(self, width: int, flat: FlatGrads | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.flat = flat  # when set, gradients are written into the buffer (zero-copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(x, self.fc1.weight, self.fc1.bias, flat=self.flat)
        return x + linear(torch.tanh(h), self.fc2.weight, self.fc2.bias, flat=self.flat)


def make_model(width: int = 32, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(depth)))


def train_step(
    model: nn.Sequential, opt: torch.optim.Optimizer, batches: list[torch.Tensor]
) -> None:
    """One optimizer step over several micro-batches, each forward in a checkpoint region."""
    for x in batches:
        with cg.save_recompute_policy(policy="recompute_all"):
            y = model(x)
        (y.square().mean() / len(batches)).backward()
    opt.step()


def main() -> None:
    model = make_model()
    reference = copy.deepcopy(model)
    flat = FlatGrads(model)
    buf = flat.buffer("cpu", torch.float32)
    print(flat, f"- {flat.nbytes / 1024:.1f} KiB")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    addresses = {p: p.grad.data_ptr() for p in flat.parameters() if p.grad is not None}

    torch.manual_seed(1)
    for step in range(3):
        batches = list(torch.randn(4, 8, 32).unbind(0))  # 4 micro-batches of 8
        flat.zero_()  # in place: addresses unchanged
        train_step(model, opt, batches)
        opt_ref.zero_grad()
        train_step(reference, opt_ref, batches)
        same_address = all(
            p.grad is not None and p.grad.data_ptr() == a for p, a in addresses.items()
        )
        bitwise = all(
            torch.equal(p, q)
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        )
        norm = buf.norm().item()  # the whole gradient, in one tensor
        print(
            f"step {step}: grad norm {norm:.4f}, .grad in buffer at fixed addresses: "
            f"{same_address}, parameters equal to the run without buffer: {bitwise}"
        )

    # Zero-copy: the backward of ckpt_graph.grads.linear writes each gradient into its slice
    # (torch.mm(..., out=slice)) and autograd adopts it; the usual path adds a fresh gradient
    # into the slice instead (`+=`).
    for block in model:
        block.flat = flat
    flat.zero_()
    buf.fill_(float("nan"))  # poison: `+=` would keep the NaN, an adopted write replaces it
    x = torch.randn(8, 32)
    with cg.save_recompute_policy(policy="recompute_all"):
        y = model(x)
    y.square().mean().backward()
    adopted = all(
        p.grad is not None
        and p.grad.data_ptr() == view.data_ptr()
        and bool(torch.isfinite(p.grad).all())
        for p, view in flat.views().items()
    )
    print(f"zero-copy backward: every gradient written in place and adopted: {adopted}")


if __name__ == "__main__":
    main()
