"""Quick start: peak memory of one training step with and without ckpt_graph.

Runs a small GPT-style decoder three ways and prints the peak memory of forward+backward
(measured with ``ckpt_graph.memory.measure``) and whether the gradients equal those of the
run without checkpointing:

1. no checkpointing;
2. one region per block (``ckpt_graph.checkpoint``), everything inside recomputed;
3. one region over all blocks, keeping every 2nd block output (``tag_with_policy``).

Usage: ``python examples/quickstart.py``
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ckpt_graph as cg
from ckpt_graph.memory import measure


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(256, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, mode: str = "none") -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        if mode == "per-block":
            for block in self.blocks:
                h = cg.checkpoint(block, h)
        elif mode == "tagged":
            with cg.save_recompute_policy("recompute_all"):
                for i, block in enumerate(self.blocks):
                    h = block(h)
                    if i % 2 == 1:
                        cg.tag_with_policy(h, True)  # keep this block output
        else:
            for block in self.blocks:
                h = block(h)
        return self.head(h)


def main() -> None:
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, 512, (8, 128))

    def step(mode: str) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logits = model(idx, mode)
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    reference = step("none")
    print(f"{'strategy':<12} {'peak MiB':>9} {'x none':>7}  gradients")
    base = None
    for mode in ("none", "per-block", "tagged"):
        step(mode)  # warm-up
        report = measure(step, mode)
        base = base or report.peak_bytes
        grads = step(mode)
        same = all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
        print(
            f"{mode:<12} {report.peak_bytes / 2**20:>9.1f} {report.peak_bytes / base:>7.2f}  "
            f"{'identical' if same else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    main()
