"""The embedded model architectures of ``ckpt-graph compare``: a GPT-style decoder, a residual
MLP and a ResNet-style CNN, each a stack of repeated blocks.

:func:`ckpt_graph.compare.zoo.build_workload` builds them with random weights and a batch.

Example:
    >>> import torch
    >>> model = ResidualMLP(width=16, layers=2)
    >>> model(torch.randn(4, 16)).shape
    torch.Size([4, 10])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "CausalSelfAttention", "ConvNet", "DecoderBlock", "ResidualMLP"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    ``eager=False`` runs ``F.scaled_dot_product_attention`` (one fused op); ``eager=True``
    spells it out as GPT-2 does, ``dropout(softmax(mask(QK^T / sqrt(d)))) @ V``, so the T x T
    scores, probabilities and dropout mask are separate tensors autograd keeps.
    """

    def __init__(self, width: int, heads: int, dropout: float, eager: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.eager = eager
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        if self.eager:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            probs = F.dropout(scores.masked_fill(future, float("-inf")).softmax(-1), p)
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)


class DecoderBlock(nn.Module):
    """Pre-LN transformer block: ``h + attn(ln1(h))`` then ``h + mlp(ln2(h))``."""

    def __init__(self, width: int, heads: int, dropout: float, eager: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout, eager)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.dropout = dropout

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        mlp = self.out(F.gelu(self.fc(self.ln2(h))))
        return h + F.dropout(mlp, self.dropout, self.training)


class GPT(nn.Module):
    """GPT-style decoder: token + position embedding, pre-LN blocks, final LayerNorm, LM head.

    ``eager_attention``: attention spelt out op by op (see :class:`CausalSelfAttention`).
    """

    def __init__(
        self,
        vocab: int,
        width: int,
        layers: int,
        heads: int,
        seq_len: int,
        dropout: float = 0.0,
        eager_attention: bool = False,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        self.dropout = dropout
        self.blocks = nn.ModuleList(
            DecoderBlock(width, heads, dropout, eager_attention) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = F.dropout(self.tok(idx) + self.pos(pos), self.dropout, self.training)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]


class ResidualMLP(nn.Module):
    """Stack of residual ``h + W2 gelu(W1 LayerNorm(h))`` blocks with a classifier head."""

    def __init__(self, width: int, layers: int, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            _Residual(
                nn.Sequential(
                    nn.LayerNorm(width),
                    nn.Linear(width, 4 * width),
                    nn.GELU(),
                    nn.Linear(4 * width, width),
                )
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


class _Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)  # type: ignore[no-any-return]


class ConvNet(nn.Module):
    """ResNet-style CNN: stem conv, residual ``conv-BN-ReLU-conv-BN`` blocks, pooled classifier."""

    def __init__(self, width: int, layers: int, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width))
        self.blocks = nn.ModuleList(
            _ResidualReLU(
                nn.Sequential(
                    nn.Conv2d(width, width, 3, padding=1, bias=False),
                    nn.BatchNorm2d(width),
                    nn.ReLU(),
                    nn.Conv2d(width, width, 3, padding=1, bias=False),
                    nn.BatchNorm2d(width),
                )
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))  # type: ignore[no-any-return]


class _ResidualReLU(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))
