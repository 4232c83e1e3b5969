"""Blocks and groups of consecutive blocks for ``torch-sqrt``: which blocks chain, one checkpoint per group.

:func:`block_modules` finds a model's blocks as the planner's hand seeds see them (the same
``planner.blocks.find_blocks``), as modules. torch.utils.checkpoint over a group of blocks
needs one function that runs the whole group. That is only possible where each block of the
group takes the previous block's output and nothing happens between them. :func:`chain_groups`
finds where that holds by watching one forward; :func:`group_forwards` turns the groups into
patched block forwards.

Example:
    >>> from ckpt_graph.compare.zoo import build_workload
    >>> w = build_workload("mlp", layers=4, width=16, batch=4)
    >>> chain_groups(w.model, w.blocks, w.inputs, k=2)
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.engine.api import save_recompute_policy
from ckpt_graph.planner.blocks import find_blocks
from ckpt_graph.planner.from_region import from_region

__all__ = ["block_modules", "chain_groups", "first_tensor", "group_forwards"]

# Note [Block chains]
# A model written as ``for block in blocks: h = block(h, **shared)`` lets torch-sqrt run blocks
# i..i+k-1 in one checkpointed function. Models written by others often do not: ConvNeXt and
# ResNet stages put a downsampling layer between two stages' blocks, a UNet concatenates a skip
# connection before each up block, T5's first block computes the position bias the others
# receive. Grouping by position alone would skip those ops or pass the wrong arguments.
# So the chain is read from one forward of the model (no gradients; buffers and RNG state
# restored afterwards), with hooks on the blocks:
# 1. block j+1 continues block j when its first positional argument *is* block j's first
#    tensor output (no op on it between them), every other argument is the same object as
#    block j's (or an equal plain value: None, numbers, strings, tuples of these), and the
#    default generator's state did not change between them (no random op in between, whose
#    order against the group's own random ops would change);
# 2. a block called more than once per forward, or never, chains with nothing;
# 3. each maximal chain is cut into consecutive groups of ``k`` blocks (the last may be
#    shorter); a block outside every chain is a group of one.
# At run time the group's first block runs the group under one checkpoint (block i with its
# own arguments, each next block with the previous output and block i's other arguments),
# which returns every block's output; each block of the group returns its own output, so a
# model that also uses an inner block's output (a UNet's skip connections, HF's
# ``output_hidden_states``) gets the right tensor. The later blocks check that they are called
# with the previous block's output (rule 1 says they are). The group's outputs are dropped
# once its last block ran, so no activation outlives the model's own references.


def first_tensor(out: object) -> torch.Tensor | None:
    """A block's output tensor: itself, or the first item of a tuple or list (HF layers)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    plain = (type(None), bool, int, float, str)
    return isinstance(a, plain) and type(a) is type(b) and a == b


class _Call:
    """One block call seen by the probe: its arguments and its first tensor output."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs
        self.rng_before = torch.get_rng_state()
        self.out: torch.Tensor | None = None
        self.rng_after: torch.Tensor | None = None

    def continues(self, prev: _Call) -> bool:
        """Rule 1 of Note [Block chains]: this call takes ``prev``'s output and its arguments."""
        if not self.args or prev.out is None or self.args[0] is not prev.out:
            return False
        if prev.rng_after is None or not torch.equal(prev.rng_after, self.rng_before):
            return False
        if len(self.args) != len(prev.args) or self.kwargs.keys() != prev.kwargs.keys():
            return False
        return _same(self.args[1:], prev.args[1:]) and all(
            _same(v, prev.kwargs[k]) for k, v in self.kwargs.items()
        )


def _probe(
    model: nn.Module, blocks: Sequence[nn.Module], inputs: tuple[torch.Tensor, ...]
) -> list[list[_Call]]:
    calls: list[list[_Call]] = [[] for _ in blocks]
    handles = []

    def pre(i: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[i].append(_Call(args, dict(kwargs)))

        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, kwargs: Any, out: object) -> None:
            calls[i][-1].out = first_tensor(out)
            calls[i][-1].rng_after = torch.get_rng_state()

        return hook

    try:
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(pre(i), with_kwargs=True))
            handles.append(block.register_forward_hook(post(i), with_kwargs=True))
        with _no_step(model), torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return calls


@contextlib.contextmanager
def _no_step(model: nn.Module) -> Iterator[None]:
    """A look at one forward that is not a training step: RNG state and buffers restored."""
    buffers = [b.detach().clone() for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)  # BatchNorm running stats


def block_modules(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[nn.Module]:
    """The blocks of ``model`` that the planner's hand seeds use, in forward order.

    Records one forward of ``model(*inputs)`` in a ckpt_graph region (RNG state and buffers
    restored, no backward) and maps the module calls that Note [Block boundaries] picks to
    the model's submodules; a block module called twice is listed once.

    Example:
        >>> from ckpt_graph.compare.zoo import build_workload
        >>> w = build_workload("mlp", layers=4, width=16, batch=4)
        >>> block_modules(w.model, w.inputs) == list(w.blocks)
        True
    """
    with _no_step(model), save_recompute_policy("recompute_all") as region:
        model(*inputs)
    g = from_region(region, dict.fromkeys(range(len(region.nodes)), 1), [])
    found = find_blocks(region.nodes, g)
    by_id = {id(m): m for m in model.modules()}
    ordered = dict.fromkeys(c.module_id for c in found.calls if c.module_id in by_id)
    return [by_id[i] for i in ordered]


def chain_groups(
    model: nn.Module, blocks: Sequence[nn.Module], inputs: tuple[torch.Tensor, ...], k: int
) -> list[list[int]]:
    """Block indices grouped as torch-sqrt checkpoints them. See Note [Block chains].

    Runs one forward of ``model`` without gradients (buffers and RNG state restored).

    Args:
        model, blocks, inputs: the workload; ``model(*inputs)`` calls the blocks.
        k: the largest group.

    Returns:
        Groups in forward order, each a list of consecutive block indices; blocks the forward
        never calls are in no group.
    """
    calls = _probe(model, blocks, inputs)
    once = [c[0] if len(c) == 1 else None for c in calls]
    groups: list[list[int]] = []
    for i in (i for i, c in enumerate(calls) if c):
        call = once[i]
        prev = once[i - 1] if i > 0 else None
        chained = (
            groups
            and groups[-1][-1] == i - 1
            and len(groups[-1]) < k
            and call is not None
            and prev is not None
            and call.continues(prev)
        )
        if chained:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def group_forwards(
    blocks: Sequence[nn.Module],
    groups: Sequence[Sequence[int]],
    checkpoint: Callable[..., Any],
) -> Callable[[int, Callable[..., Any]], Callable[..., Any] | None]:
    """A ``wrap(i, forward)`` for the strategies' block patching that runs each group as one.

    The group's first block runs ``checkpoint(run_group, *args, **kwargs)``; the other blocks
    return their own output computed there. See Note [Block chains].

    Raises (from the returned forwards):
        CkptGraphValueError: a later block of a group was called with something other than
            the group's output (the model's control flow changed since :func:`chain_groups`).
    """
    first_of = {g[0]: list(g) for g in groups if len(g) > 1}
    member_of = {i: g[0] for g in groups if len(g) > 1 for i in g[1:]}
    pending: dict[int, tuple[Any, ...]] = {}  # group start -> outputs, until its last block
    originals = [b.forward for b in blocks]  # before the strategy patches any of them

    def wrap(i: int, forward: Callable[..., Any]) -> Callable[..., Any] | None:
        if i in first_of:
            group = first_of[i]
            own = [forward, *(originals[j] for j in group[1:])]

            def run_group(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
                outs = [own[0](*args, **kwargs)]
                for fwd in own[1:]:
                    outs.append(fwd(first_tensor(outs[-1]), *args[1:], **kwargs))
                return tuple(outs)

            def start(*args: Any, **kwargs: Any) -> object:
                outs = checkpoint(run_group, *args, **kwargs)
                pending[i] = outs
                return outs[0]

            return start
        if i in member_of:
            head = member_of[i]
            last = i == first_of[head][-1]
            pos = first_of[head].index(i)

            def follow(*args: Any, **kwargs: Any) -> object:
                outs = pending.pop(head, None) if last else pending.get(head)
                if outs is None or not args or args[0] is not first_tensor(outs[pos - 1]):
                    raise CkptGraphValueError(
                        f"ckpt_graph: torch-sqrt: block {i} was not called with the output of "
                        f"block {i - 1} (group {first_of[head]}); the model's forward changed "
                        "since its blocks were grouped: build the strategy's forward again"
                    )
                return outs[pos]

            return follow
        # A group of one: checkpoint the block alone (as torch-ckpt does).
        return lambda *args, **kwargs: checkpoint(forward, *args, **kwargs)

    return wrap
