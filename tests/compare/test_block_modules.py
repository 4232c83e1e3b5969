"""``groups.block_modules``: the planner's blocks (Note [Block boundaries]) as the model's modules.

The same finder that gives ``memory_budget`` its hand seeds, read back as modules: it must name
exactly the blocks that the zoo lists by hand for torch's per-block checkpoints, and looking
must not be a training step (RNG state and BatchNorm running stats unchanged).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ckpt_graph.compare.groups import block_modules, chain_groups
from ckpt_graph.compare.zoo import build_workload

CASES = [
    ("gpt", dict(layers=3, width=16, batch=2, seq_len=8)),
    ("mlp", dict(layers=4, width=16, batch=4)),
    ("cnn", dict(layers=3, width=4, batch=2, seq_len=8)),
    ("torch-loop", dict(layers=3, width=16, batch=1, seq_len=8)),
    ("hf-convnext", dict(layers=2, width=8, batch=2, seq_len=32)),
]


@pytest.mark.parametrize(("name", "sizes"), CASES, ids=[c[0] for c in CASES])
def test_block_modules_are_the_zoo_blocks_and_leave_no_trace(
    name: str, sizes: dict[str, int]
) -> None:
    if name.startswith("hf-") and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    w = build_workload(name, **sizes)  # type: ignore[arg-type]
    buffers = [b.clone() for b in w.model.buffers()]
    rng = torch.get_rng_state()
    found = block_modules(w.model, w.inputs)
    assert found == list(w.blocks)
    assert torch.equal(torch.get_rng_state(), rng)
    for b, before in zip(w.model.buffers(), buffers, strict=True):
        assert torch.equal(b, before)
    # torch-sqrt's chains over the found blocks: plain stacks chain end to end
    groups = chain_groups(w.model, found, w.inputs, k=len(found))
    if name in ("gpt", "mlp", "cnn", "torch-loop"):
        assert groups == [list(range(len(found)))]
