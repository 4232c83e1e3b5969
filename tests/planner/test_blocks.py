"""Block boundaries from the program: module calls, names, repeated op sequences.

See Note [Block boundaries] in ``ckpt_graph/planner/blocks.py``. Each test records one region
and checks which op nodes ``find_blocks`` puts in which block, against the modules that ran
them (or, for a functional model, the loop iteration that ran them).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch
from torch import nn

import ckpt_graph as cg
from ckpt_graph.compare.third_party import SPECS
from ckpt_graph.compare.zoo import THIRD_PARTY, Workload, build_workload
from ckpt_graph.engine.region import Region
from ckpt_graph.planner.blocks import Blocks, find_blocks, module_blocks
from ckpt_graph.planner.from_region import from_region
from ckpt_graph.planner.hand_seeds import hand_seeds
from ckpt_graph.planner.solve import candidate_ops

pytestmark = pytest.mark.usefixtures("one_thread")


def _record(fn: Callable[[], torch.Tensor]) -> tuple[Region, Blocks]:
    with cg.save_recompute_policy("recompute_all") as region:
        out = fn()
    g = from_region(region, {j: 1 for j in range(len(region.nodes))}, [])
    found = find_blocks(region.nodes, g)
    out.sum().backward()
    return region, found


def _owner_ids(region: Region, blocks: list[nn.Module]) -> list[int]:
    """Per op node, the index of the block among ``blocks`` whose forward ran it (-1: none)."""
    index = {id(b): i for i, b in enumerate(blocks)}
    ids = []
    for node in region.nodes:
        call, owner = node.module_call, -1
        while call is not None:
            owner = index.get(call.module_id, owner)
            call = call.parent
        ids.append(owner)
    return ids


class _Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.ln(x))))


def test_blocks_called_in_a_loop_without_a_parent_module() -> None:
    # each block is an outermost module, named "": names cannot tell them apart
    blocks = [_Block(8) for _ in range(5)]
    head = nn.Linear(8, 3)
    x = torch.randn(4, 8)

    def forward() -> torch.Tensor:
        h = x * 2
        for b in blocks:
            h = b(h)
        return head(h)

    region, found = _record(forward)
    assert {n.module_path for n in region.nodes if n.module_call is not None} >= {"", "ln"}
    assert found.source == "modules: _Block"
    assert list(found.ids) == _owner_ids(region, list(blocks))
    assert found.count == 5 and found.ids[0] == -1 and found.ids[-1] == -1


class _ConvLayer(nn.Sequential):
    """conv-BN-ReLU, no branch: a part of a block."""

    def __init__(self, c: int) -> None:
        super().__init__(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())


class _Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(_ConvLayer(c), _ConvLayer(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


def _stages(depths: list[int], c: int) -> tuple[nn.Module, list[nn.Module]]:
    """ConvNeXt/ResNet layout: stages of residual blocks, downsampling between stages."""
    stages: list[nn.Module] = []
    blocks: list[nn.Module] = []
    for i, depth in enumerate(depths):
        own = [_Residual(c) for _ in range(depth)]
        blocks += own
        down = nn.Identity() if i == 0 else nn.Conv2d(c, c, 2, stride=2)
        stages.append(nn.Sequential(down, nn.Sequential(*own)))
    model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), *stages, nn.AdaptiveAvgPool2d(1))
    return model, blocks


def test_stages_with_downsampling_give_their_blocks_not_themselves() -> None:
    depths = [2, 1, 3]
    model, blocks = _stages(depths, 4)
    x = torch.randn(2, 3, 16, 16)
    region, found = _record(lambda: model(x))
    assert found.source == "modules: _Residual"
    assert found.count == sum(depths)
    assert list(found.ids) == _owner_ids(region, blocks)
    # the stem, the downsampling convolutions and the pooling are outside every block
    assert sum(1 for b in found.ids if b == -1) > len(depths)


def test_repeated_non_branching_layers_are_parts_not_blocks() -> None:
    # _ConvLayer repeats more often and covers as much, but never branches (rule 1b)
    model, _ = _stages([4], 4)
    _, found = _record(lambda: model(torch.randn(2, 3, 8, 8)))
    assert found.count == 4 and found.source == "modules: _Residual"


def test_a_class_beside_the_blocks_adds_its_calls() -> None:
    # rule 1e: attention layers between residual blocks, as in a UNet's levels
    class Attn(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.qkv = nn.Linear(c, 3 * c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return x + torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v

    mods: list[nn.Module] = [_Block(8), Attn(8), _Block(8), Attn(8), _Block(8)]
    model = nn.Sequential(*mods)
    region, found = _record(lambda: model(torch.randn(2, 5, 8)))
    assert found.source == "modules: _Block + Attn"
    assert list(found.ids) == _owner_ids(region, mods)


def _functional(n_blocks: int) -> tuple[Callable[[], torch.Tensor], int]:
    torch.manual_seed(0)
    ws = [(torch.randn(8, 16, requires_grad=True), torch.randn(16, 8)) for _ in range(n_blocks)]
    x = torch.randn(4, 8)

    def forward() -> torch.Tensor:
        h = torch.tanh(x)  # one op before the blocks
        for w1, w2 in ws:
            h = h + torch.relu(h @ w1) @ w2  # mm, relu, mm, add
        return (h * h).sum(dim=1)

    return forward, 4


def test_a_functional_model_gets_blocks_from_repeated_op_sequences() -> None:
    forward, per_block = _functional(6)
    region, found = _record(forward)
    assert all(n.module_call is None and n.module_path == "" for n in region.nodes)
    assert found.source == f"graph: period {per_block}"
    names = [n.op.__name__.split(".")[0] for n in region.nodes]
    expected = [-1] + [b for b in range(6) for _ in range(per_block)]
    expected += [-1] * (len(names) - len(expected))
    assert list(found.ids) == expected
    assert names[1:5] == ["mm", "relu", "mm", "add"]


def test_a_region_over_one_layer_has_no_blocks() -> None:
    # rule 1f: the layer's linear layers, norms and dropouts repeat, but are parts of it
    layer = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True)
    _, found = _record(lambda: layer(torch.randn(2, 5, 16)))
    assert found.count == 0 and found.source == "none"


class _Functional(nn.Module):
    """One module whose forward loops over its weights: the calls say nothing."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w1 = nn.ParameterList(torch.randn(8, 16) for _ in range(n))
        self.w2 = nn.ParameterList(torch.randn(16, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)
        for w1, w2 in zip(self.w1, self.w2, strict=True):
            h = h + torch.relu(h @ w1) @ w2
        return h


def test_calls_that_say_nothing_fall_back_to_the_graph() -> None:
    model, x = _Functional(5), torch.randn(4, 8)
    region, found = _record(lambda: model(x))
    assert all(n.module_call is not None for n in region.nodes[:-1])  # the last: sum()
    assert found.source == "graph: period 4" and found.count == 5


def test_no_blocks_where_nothing_repeats() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    _, found = _record(lambda: torch.tanh(x @ x.t()).exp())
    assert found.count == 0 and found.source == "none"


class _Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_names_are_the_fallback_without_call_records() -> None:
    model = _Stack(3)
    with cg.save_recompute_policy("recompute_all") as region:
        model(torch.randn(2, 8)).sum().backward()
    for node in region.nodes:
        node.module_call = None  # as for op nodes made outside the module hooks
    found = find_blocks(region.nodes)
    assert found.source == "names: layers"
    paths = [n.module_path.split(".") for n in region.nodes]
    assert list(found.ids) == [int(p[1]) if p[0] == "layers" else -1 for p in paths]


def test_module_blocks_without_calls_finds_none() -> None:
    assert module_blocks([None, None]).count == 0


# --------------------------------------------------------------------------- the zoo

LIBRARY = {**{n: s.library for n, s in SPECS.items()}, "hf-gpt2": "transformers"}
LIBRARY["hf-llama"] = "transformers"
SIZES: dict[str, dict[str, int]] = {
    "hf-gpt2": dict(layers=3, width=32, batch=1, seq_len=16),
    "hf-llama": dict(layers=3, width=32, batch=1, seq_len=16),
    "hf-bert": dict(layers=3, width=32, batch=1, seq_len=16),
    "hf-t5": dict(layers=2, width=32, batch=1, seq_len=16),
    "hf-mixtral": dict(layers=3, width=32, batch=1, seq_len=16),
    "hf-vit": dict(layers=3, width=32, batch=1, seq_len=16),
    "hf-swin": dict(layers=3, width=16, batch=1, seq_len=64),
    "hf-convnext": dict(layers=4, width=8, batch=2, seq_len=32),
    "hf-mobilenetv2": dict(layers=16, width=8, batch=2, seq_len=32),
    "hf-efficientnet": dict(layers=10, width=8, batch=2, seq_len=32),
    "hf-resnet": dict(layers=8, width=8, batch=2, seq_len=32),
    "diffusers-unet": dict(layers=2, width=8, batch=1, seq_len=16),
    "torch-loop": dict(layers=3, width=32, batch=1, seq_len=8),
}


def _expected_count(name: str, w: Workload) -> int:
    """Blocks by the model's config (or, for fixed architectures, its block list)."""
    model = w.model
    config = getattr(model, "config", None)
    if name == "hf-gpt2":
        return int(config.n_layer)  # type: ignore[union-attr]
    if name in ("hf-llama", "hf-bert", "hf-mixtral", "hf-vit"):
        return int(config.num_hidden_layers)  # type: ignore[union-attr]
    if name == "hf-t5":
        return int(config.num_layers + config.num_decoder_layers)  # type: ignore[union-attr]
    if name in ("hf-swin", "hf-convnext", "hf-resnet"):
        return sum(config.depths)  # type: ignore[union-attr]
    if name == "hf-mobilenetv2":
        return len(model.mobilenet_v2.layer)  # type: ignore[union-attr, arg-type]
    if name == "hf-efficientnet":
        return len(model.efficientnet.encoder.blocks)  # type: ignore[union-attr, arg-type]
    if name == "diffusers-unet":
        per, levels = int(config.layers_per_block), len(config.down_block_types)  # type: ignore[union-attr]
        resnets = per * levels + (per + 1) * levels + 2  # down, up, mid
        attn_levels = sum("Attn" in t for t in config.down_block_types)  # type: ignore[union-attr]
        return resnets + attn_levels * (per + (per + 1)) + 1  # down, up, mid
    assert name == "torch-loop"
    return len(model.blocks)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", *THIRD_PARTY])
def test_each_zoo_model_gets_its_blocks(name: str) -> None:
    if importlib.util.find_spec(LIBRARY[name]) is None:
        pytest.skip(f"{LIBRARY[name]} is not installed")
    torch.manual_seed(0)
    w = build_workload(name, **SIZES[name])  # type: ignore[arg-type]
    with cg.save_recompute_policy("recompute_all") as region:
        out = w.model(*w.inputs)
    g = from_region(region, {j: 1 for j in range(len(region.nodes))}, [])
    found = find_blocks(region.nodes, g)
    assert found.count == _expected_count(name, w), found.source
    # the blocks are the zoo's hand-listed blocks, in order (torch-ckpt checkpoints these)
    assert [c.module_id for c in found.calls] == [id(b) for b in w.blocks]
    assert list(found.ids) == _owner_ids(region, list(w.blocks))
    seeds = hand_seeds(g, candidate_ops(g), found.ids)
    assert {"block inputs", "blocks/2"} <= set(seeds)
    w.loss(out).backward()
