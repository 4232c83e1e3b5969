"""The pieces of the torch.compile lowering that need no compiler: which policies lower, and
module paths from FX metadata. The compiled behaviour is in tests/integration/test_compile.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph import policies
from ckpt_graph.engine.lowering import (
    LoweredPolicy,
    compile_fraction,
    module_path_from_meta,
    needs_region,
    runs_eagerly,
)

aten = torch.ops.aten


class Block(torch.nn.Module):
    pass


class Attn(torch.nn.Module):
    pass


@pytest.mark.parametrize(
    ("policy", "needs"),
    [
        ("recompute_all", False),
        (policies.save_matmuls(), False),
        (policies.recompute_ops(aten.gelu), False),
        (policies.offload(lambda *a, **k: True), False),
        (lambda ctx, out, op, *a, **k: None, False),
        (policies.memory_budget(0.5), True),
        (policies.save_module_outputs(torch.nn.Linear), True),
        (policies.first_answer(policies.save_ops(aten.mm, rest=None), "recompute_all"), False),
        (policies.any_save(policies.save_matmuls(), policies.memory_budget(0.5)), True),
    ],
)
def test_needs_region(policy: Any, needs: bool) -> None:
    assert needs_region(policy) is needs


@pytest.mark.parametrize(
    ("policy", "fraction", "eager"),
    [
        ("recompute_all", None, False),
        (policies.save_matmuls(), None, False),
        (policies.memory_budget(0.5), 0.5, False),
        (policies.memory_budget("40%"), 0.4, False),
        (policies.memory_budget(1.0), 1.0, False),
        (policies.memory_budget("64MiB"), None, True),
        (policies.save_module_outputs(torch.nn.Linear), None, True),
        (policies.any_save(policies.save_matmuls(), policies.memory_budget(0.5)), None, True),
    ],
)
def test_memory_budget_fraction_is_planned_by_the_partitioner(
    policy: Any, fraction: float | None, eager: bool
) -> None:
    """A memory_budget fraction lowers (the partitioner plans it); bytes, module-output tags
    and combinators holding a memory_budget still run eagerly. See Note [Regions under
    torch.compile] (5)."""
    assert compile_fraction(policy) == fraction
    assert runs_eagerly(policy) is eager


STACK = {
    "L__self__": ("L['self']", torch.nn.Module),
    "L__self___blocks_0": ("L['self'].blocks[0]", Block),
    "L__self___blocks_0_attn": ("L['self'].blocks[0].attn", Attn),
    "L__self___blocks_0_attn_qkv": ("L['self'].blocks[0].attn.qkv", torch.nn.Linear),
}


def test_module_path_as_eager_names_it() -> None:
    # wrap(): the block's forward body runs in the region; attn is the outermost module called
    assert module_path_from_meta(STACK, Block, root_called=False) == "qkv"
    # checkpoint(block, h): the block itself is called inside the region
    assert module_path_from_meta(STACK, Block, root_called=True) == "attn.qkv"
    # checkpoint(fn, h) with a plain function: relative to the compiled frame's root
    assert module_path_from_meta(STACK, None, root_called=True) == "blocks.0.attn.qkv"
    assert module_path_from_meta(dict(list(STACK.items())[:2]), Block, False) == ""
    assert module_path_from_meta(None, Block, False) == ""


class _SacCtx:
    def __init__(self, out: Any) -> None:
        self.op_output = out
        self.is_recompute = False


def test_lowered_policy_resolves_the_stack_and_counts() -> None:
    """The stack resolves as in eager; offload lowers to save with a warning; kept bytes add up."""
    lowered = LoweredPolicy(
        [
            policies.offload(lambda ctx, out, op, *a, **k: op is aten.relu.default),
            policies.save_ops(aten.mm),
        ]
    )
    a = torch.randn(4, 4)
    mm = torch.mm(a, a)
    assert lowered(_SacCtx(mm), aten.mm.default, a, a) is CheckpointPolicy.MUST_SAVE
    relu = torch.relu(a)
    # the inner save_ops answers PREFER_RECOMPUTE, replacing the outer PREFER_CPU_OFFLOAD
    assert lowered(_SacCtx(relu), aten.relu.default, a) is CheckpointPolicy.PREFER_RECOMPUTE
    assert lowered.ctx.op_index == 2
    assert lowered.ctx.kept_bytes == mm.numel() * 4
    offloading = LoweredPolicy([policies.offload(lambda *args, **kw: True, must=True)])
    with pytest.warns(UserWarning, match="answered MUST_CPU_OFFLOAD under torch.compile"):
        decision = offloading(_SacCtx(relu), aten.relu.default, a)
    assert decision is CheckpointPolicy.MUST_SAVE
