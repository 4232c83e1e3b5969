"""Block boundaries of an encoder-decoder whose encoder and decoder layers are two classes.

Found by ``benchmarks/bench_zoo.py --extra`` on transformers' BART: its attention class (six
calls: one per encoder layer, two per decoder layer) won over the layers (two classes of two
calls each), so the hand seeds checkpointed attention modules and left the MLPs outside every
block. Rule 1g of Note [Block boundaries] makes the enclosing layers the blocks. Here the same
layout in plain PyTorch, and the cases the rule must leave alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_graph as cg
from ckpt_graph.planner.blocks import Blocks, find_blocks
from ckpt_graph.planner.from_region import from_region
from ckpt_graph.planner.hand_seeds import hand_seeds
from ckpt_graph.planner.solve import candidate_ops

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH = 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.kv = nn.Linear(WIDTH, 2 * WIDTH)
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        k, v = self.kv(x if memory is None else memory).chunk(2, dim=-1)
        return self.o(F.scaled_dot_product_attention(self.q(x), k, v))  # type: ignore[no-any-return]


class EncoderLayer(nn.Module):
    """Post-norm encoder layer; its MLP is its own linear layers, not a module."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.cross_attn = Attention()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)
        self.ln3 = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.self_attn(x))
        x = self.ln2(x + self.cross_attn(x, memory))
        return self.ln3(x + self.fc2(F.gelu(self.fc1(x))))  # type: ignore[no-any-return]


class EncoderDecoder(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(EncoderLayer() for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer() for _ in range(layers))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            src = layer(src)
        for layer in self.decoder:
            tgt = layer(tgt, src)
        return tgt


def _found(model: nn.Module, *inputs: torch.Tensor) -> tuple[Blocks, dict[str, frozenset[int]]]:
    with cg.save_recompute_policy("recompute_all") as region:
        out = model(*inputs)
    g = from_region(region, {j: 1 for j in range(len(region.nodes))}, [])
    found = find_blocks(region.nodes, g)
    seeds = hand_seeds(g, candidate_ops(g), found.ids)
    out.sum().backward()
    return found, seeds


def test_encoder_and_decoder_layers_are_the_blocks() -> None:
    torch.manual_seed(0)
    model = EncoderDecoder()
    found, seeds = _found(model, torch.randn(2, 8, WIDTH), torch.randn(2, 4, WIDTH))
    assert found.source == "modules: EncoderLayer + DecoderLayer"
    layers = [*model.encoder, *model.decoder]
    assert [c.module_id for c in found.calls] == [id(m) for m in layers]
    assert found.count == 4
    assert {"block inputs", "blocks/2"} <= set(seeds)


def test_blocks_of_one_class_inside_repeated_stages_stay_the_blocks() -> None:
    # Stages whose layers cover them: the layers are the blocks, not the stages (rule 1c).
    torch.manual_seed(0)
    stages = nn.ModuleList(nn.Sequential(EncoderLayer(), EncoderLayer()) for _ in range(2))

    def forward(x: torch.Tensor) -> torch.Tensor:
        for stage in stages:
            x = stage(x)
        return x

    found, _ = _found(forward, torch.randn(2, 8, WIDTH))  # type: ignore[arg-type]
    assert found.source == "modules: EncoderLayer"
    assert [c.module_id for c in found.calls] == [id(m) for s in stages for m in s]


def test_gradients_under_the_block_seeds_are_exact() -> None:
    # The hand seeds' per-block plans reach the budget planner: a budget at half of the
    # activations runs and its gradients equal plain eager's.
    from ckpt_graph.policies import memory_budget

    torch.manual_seed(0)
    model = EncoderDecoder()
    src, tgt = torch.randn(2, 8, WIDTH), torch.randn(2, 4, WIDTH)
    model(src, tgt).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    policy = memory_budget(0.5, flops_per_byte=2.0)
    for _ in range(2):  # the first step records and plans; the second runs the plan
        model.zero_grad(set_to_none=True)
        with cg.save_recompute_policy(policy):
            out = model(src, tgt)
        out.sum().backward()
    for n, g in ref.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, rtol=0, atol=0)
