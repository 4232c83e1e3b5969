"""torch-sqrt's groups of blocks (``compare.groups``): chains read from one forward."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckpt_graph import CkptGraphValueError
from ckpt_graph.compare.groups import chain_groups, group_forwards
from ckpt_graph.compare.runner import run_comparison
from ckpt_graph.compare.zoo import build_workload

pytestmark = pytest.mark.usefixtures("one_thread")


class _Staged(nn.Module):
    """Two stages of three blocks with a downsampling op between them, plus a block called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks[:3]:
            x = b(x)
        x = x * 0.5  # between the stages: the chain breaks here
        for b in self.blocks[3:6]:
            x = b(x)
        return self.blocks[6](self.blocks[6](x))  # called twice: a group of its own


def test_chain_groups_break_at_ops_between_blocks() -> None:
    model = _Staged()
    x = torch.randn(2, 8)
    assert chain_groups(model, list(model.blocks), (x,), k=2) == [[0, 1], [2], [3, 4], [5], [6]]
    assert chain_groups(model, list(model.blocks), (x,), k=3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_group_forwards_exact_and_restored() -> None:
    torch.manual_seed(0)
    model = _Staged()
    x = torch.randn(2, 8)
    ref = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    blocks = list(model.blocks)
    groups = chain_groups(model, blocks, (x,), k=3)
    wrap = group_forwards(blocks, groups, functools.partial(checkpoint, use_reentrant=False))
    for i, b in enumerate(blocks):
        b.forward = wrap(i, b.forward)  # type: ignore[method-assign]
    got = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


class _Skips(nn.Module):
    """Block 0's output feeds block 1 and also a skip connection; a dropout before block 3."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        h0 = self.blocks[0](x)
        h = self.blocks[2](self.blocks[1](h0))
        other = torch.nn.functional.dropout(other, 0.5)  # random, between blocks 2 and 3
        return self.blocks[3](h) + h0 + other


def test_inner_outputs_and_random_ops_between_blocks() -> None:
    torch.manual_seed(0)
    model = _Skips()
    x, other = torch.randn(2, 8), torch.randn(2, 8)
    blocks = list(model.blocks)
    groups = chain_groups(model, blocks, (x, other), k=4)
    assert groups == [[0, 1, 2], [3]]  # the dropout's place in the RNG stream is kept
    torch.manual_seed(1)
    ref = torch.autograd.grad(model(x, other).sum(), list(model.parameters()))
    wrap = group_forwards(blocks, groups, functools.partial(checkpoint, use_reentrant=False))
    for i, b in enumerate(blocks):
        b.forward = wrap(i, b.forward)  # type: ignore[method-assign]
    torch.manual_seed(1)
    got = torch.autograd.grad(model(x, other).sum(), list(model.parameters()))
    for a, b in zip(ref, got, strict=True):  # h0 is block 0's own output, not block 2's
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_group_member_called_with_something_else() -> None:
    model = _Staged()
    blocks = list(model.blocks)
    wrap = group_forwards(blocks, [[0, 1, 2]], functools.partial(checkpoint, use_reentrant=False))
    follower = wrap(1, blocks[1].forward)
    assert follower is not None
    with pytest.raises(CkptGraphValueError, match=r"torch-sqrt: block 1 was not called with"):
        follower(torch.randn(2, 8))


class _BiasedLinear(nn.Linear):
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x) if bias is None else super().forward(x) + bias


def test_block_arguments_must_match() -> None:
    # As in T5: the first block gets no bias and the later ones share one tensor.
    class Biased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_BiasedLinear(4, 4) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shared = torch.ones(4)
            x = self.blocks[0](x)
            for b in self.blocks[1:3]:
                x = b(x, bias=shared)
            return self.blocks[3](x, bias=torch.ones(4))  # an equal but different tensor

    model = Biased()
    x = torch.randn(1, 4)
    assert chain_groups(model, list(model.blocks), (x,), k=4) == [[0], [1, 2], [3]]


@pytest.mark.parametrize(
    ("model", "sizes", "groups"),
    [
        # stage depths (1, 1, 2, 1): a downsampling layer between stages
        ("hf-convnext", dict(layers=2, width=8, batch=2, seq_len=32), [[0], [1], [2, 3], [4]]),
        # encoder block 0 computes the position bias; the decoder's block 0 too
        ("hf-t5", dict(layers=3, width=32, batch=2, seq_len=8), [[0], [1, 2], [3], [4, 5]]),
        # the last down block's resnet feeds the mid block (and a skip connection)
        (
            "diffusers-unet",
            dict(layers=1, width=8, batch=2, seq_len=16),
            [[0], [1], [2], [3, 4], *([i] for i in range(5, 15))],
        ),
    ],
)
def test_torch_sqrt_on_third_party_models(
    model: str, sizes: dict[str, int], groups: list[list[int]]
) -> None:
    library = "diffusers" if model.startswith("diffusers") else "transformers"
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"needs {library}")
    w = build_workload(model, **sizes)  # type: ignore[arg-type]
    k = round(len(w.blocks) ** 0.5)
    assert chain_groups(w.model, w.blocks, w.inputs, k) == groups
    results = run_comparison(
        model,
        **sizes,  # type: ignore[arg-type]
        strategies=["none", "torch-sqrt"],
        repeat=1,
        count_ops=False,
        threads=1,
    )
    for r in results:
        assert r.status == "ok", f"{r.strategy}: {r.note}"
        assert r.max_grad_diff == 0.0 and r.max_buffer_diff == 0.0, r.strategy
