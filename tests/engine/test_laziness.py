"""Laziness and policy semantics, observed through ops that count their calls.

``counted`` (sin, saves its input) and ``counted_exp`` (exp, saves its output) are custom ops
(``tests/models.py``) that count every call, so the number of recomputations is exact: one call
in forward, one more for each time backward recomputes them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import CALLS, LIVE_OUTPUTS, const_policy, counted, counted_exp, counted_pair, leaf
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg

MUST_SAVE = CheckpointPolicy.MUST_SAVE
PREFER_SAVE = CheckpointPolicy.PREFER_SAVE
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


def _eager_grad(fn: Any, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    xs = [leaf(*s, seed=i) for i, s in enumerate(shapes)]
    fn(*xs).sum().backward()
    CALLS.clear()
    return [x.grad for x in xs]


# --------------------------------------------------------------------------- laziness


UNNEEDED: dict[str, Any] = {
    # counted saves only its input (a region input or a recomputable sin); nothing needs its output
    "sum": lambda x: counted(x).sum() * 1,
    "sum_of_recomputed_input": lambda x: counted(x.cos()).sum(),
    "scaled": lambda x: counted(x.exp()) * 2,
    "added": lambda x: (counted(x) + x.sin()).sum(),
    "view_then_sum": lambda x: counted(x).view(-1).sum(),
}


@pytest.mark.parametrize(
    "policy", ["recompute_all", const_policy(MUST_RECOMPUTE, "must_recompute")]
)
@pytest.mark.parametrize("name", list(UNNEEDED))
def test_unneeded_op_is_never_recomputed(name: str, policy: Any) -> None:
    fn = UNNEEDED[name]
    expected = _eager_grad(fn, (3, 4))
    x = leaf(3, 4)
    with cg.save_recompute_policy(policy):
        y = fn(x)
    assert CALLS["counted"] == 1
    y.sum().backward()
    assert CALLS["counted"] == 1
    torch.testing.assert_close(x.grad, expected[0], rtol=0, atol=0)


NEEDED_TWICE: dict[str, tuple[Any, str]] = {
    # the counted op's output is needed by two (or more) saved tensors
    "sin_and_cos_save_it": (lambda x: counted(x).sin() * counted_exp(x.cos()).cos(), "counted"),
    "two_consumers_recomputed": (
        lambda x: (lambda a: a.exp() * a.tanh())(counted(x * 2)),
        "counted",
    ),
    "self_saved_and_consumer": (
        lambda x: (lambda a: a * a.sin())(counted_exp(x.sin())),
        "counted_exp",
    ),
    "views_of_it": (lambda x: (lambda a: a[0] * a[1])(counted(x)), "counted"),
}


@pytest.mark.parametrize("name", list(NEEDED_TWICE))
def test_op_needed_twice_is_recomputed_once(name: str) -> None:
    fn, op = NEEDED_TWICE[name]
    expected = _eager_grad(fn, (3, 4))
    x = leaf(3, 4)
    with cg.save_recompute_policy("recompute_all"):
        y = fn(x)
    assert CALLS[op] == 1
    y.sum().backward()
    assert CALLS[op] == 2
    torch.testing.assert_close(x.grad, expected[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(NEEDED_TWICE) + list(UNNEEDED))
def test_must_save_all_recomputes_nothing(name: str) -> None:
    fn = NEEDED_TWICE[name][0] if name in NEEDED_TWICE else UNNEEDED[name]
    expected = _eager_grad(fn, (3, 4))
    x = leaf(3, 4)
    with cg.save_recompute_policy("must_save_all"):
        y = fn(x)
    calls = dict(CALLS)
    y.sum().backward()
    assert dict(CALLS) == calls
    torch.testing.assert_close(x.grad, expected[0], rtol=0, atol=0)


def test_only_the_needed_branch_is_recomputed() -> None:
    # Two branches; backward of the second needs nothing from the first's counted op.
    x, w = leaf(3, 4), leaf(3, 4, seed=1)
    with cg.save_recompute_policy("recompute_all"):
        a = counted_exp(x)  # saves its output: needed
        b = counted(w)  # saves its input (w, kept): output needed by nobody
        y = a.sum() + b.sum()
    del a, b  # a value the program still holds is not recomputed (Note [Live forward tensors])
    y.backward()
    assert CALLS["counted_exp"] == 2 and CALLS["counted"] == 1


def test_partial_backward_recomputes_only_its_part() -> None:
    x, w = leaf(3, 4), leaf(3, 4, seed=1)
    with cg.save_recompute_policy("recompute_all"):
        a = counted_exp(x)
        b = counted_exp(w)
        y = (a * 2).sum() + (b * 3).sum()
    del a, b
    (gx,) = torch.autograd.grad(y, [x], retain_graph=True)
    assert CALLS["counted_exp"] == 3  # two forward calls + a's recompute only
    torch.testing.assert_close(gx, 2 * x.detach().exp(), rtol=0, atol=0)


def test_long_chain_each_op_recomputed_once() -> None:
    x = leaf(3)
    with cg.save_recompute_policy("recompute_all"):
        h = x
        for _ in range(10):
            h = counted_exp(h * 0.1)
    assert CALLS["counted_exp"] == 10
    loss = h.sum()
    del h  # the last value is recomputed too when the program no longer holds it
    loss.backward()
    assert CALLS["counted_exp"] == 20


def test_unneeded_output_of_recomputed_multi_output_op_dropped_at_once() -> None:
    # counted_pair returns (sin, cos); only sin's value is needed in backward. When backward
    # recomputes the pair, cos must be freed at once, not cached until the end of the pass.
    x = leaf(3, 4)
    seen: list[list[bool]] = []
    with cg.save_recompute_policy("recompute_all"):
        s, c = counted_pair(x * 2)
        y = s.sin().sum() + c.sum()  # sin saves s; nothing saves c
    s.register_hook(lambda g: seen.append([r() is not None for r in LIVE_OUTPUTS]))
    del s, c
    y.backward()
    assert CALLS["counted_pair"] == 2
    # LIVE_OUTPUTS: forward (s, c), then recompute (s, c); the hook ran right after sin's backward
    assert len(seen) == 1 and len(seen[0]) == 4
    assert seen[0][3] is False, "the unneeded output of the recomputed op is still alive"
    expected = leaf(3, 4)
    (lambda a, b: a.sin().sum() + b.sum())(*counted_pair(expected * 2)).backward()
    torch.testing.assert_close(x.grad, expected.grad, rtol=0, atol=0)


def test_recomputed_values_freed_after_their_last_use() -> None:
    # h_{i+1} = counted_exp(h_i * 0.5): each output is saved by its own backward only. The first
    # unpack (of h5) recomputes h1..h5 once; each cached value must be freed as soon as its own
    # backward node has unpacked it, while the ones still pending stay cached (no re-run).
    n = 5
    x = leaf(3, 4)
    seen: dict[int, list[bool]] = {}
    with cg.save_recompute_policy("recompute_all"):
        hs = [x]
        for _ in range(n):
            hs.append(counted_exp(hs[-1] * 0.5))
        y = hs[-1].sum()

    def snapshot(k: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            seen[k] = [r() is not None for r in LIVE_OUTPUTS[n:]]

        return hook

    for k in range(1, n):
        hs[k].register_hook(snapshot(k))
    del hs
    y.backward()
    assert CALLS["counted_exp"] == 2 * n
    for k in range(1, n):  # at h_k's gradient hook, h_1..h_k are pending, h_{k+1}..h_n are done
        assert seen[k] == [j <= k for j in range(1, n + 1)], (k, seen[k])
    assert not any(r() is not None for r in LIVE_OUTPUTS)


# --------------------------------------------------------------------------- policy stack


def _answer(value: Any, name: str) -> Any:
    """A policy that answers ``value`` for the counted ops and abstains elsewhere."""

    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return value if "counted" in str(op) else None

    policy.__name__ = policy.__qualname__ = name
    return policy


# (answers outermost first, counted op recomputed?)
STACKS: list[tuple[list[Any], bool]] = [
    ([None], False),  # the starting decision is PREFER_SAVE
    ([None, None], False),
    ([True], False),
    ([False], True),
    ([PREFER_RECOMPUTE], True),
    ([MUST_RECOMPUTE], True),
    ([MUST_SAVE, PREFER_RECOMPUTE], False),  # MUST beats a later PREFER
    ([PREFER_RECOMPUTE, MUST_SAVE], False),  # MUST beats an earlier PREFER
    ([MUST_RECOMPUTE, PREFER_SAVE], True),
    ([PREFER_SAVE, MUST_RECOMPUTE], True),
    ([PREFER_SAVE, PREFER_RECOMPUTE], True),  # a later PREFER replaces an earlier one
    ([PREFER_RECOMPUTE, PREFER_SAVE], False),
    ([PREFER_RECOMPUTE, None], True),  # None abstains
    ([None, PREFER_RECOMPUTE], True),
    ([MUST_SAVE, None, PREFER_RECOMPUTE], False),  # at any depth
    ([PREFER_SAVE, MUST_RECOMPUTE, PREFER_SAVE, False], True),
    ([False, None, True, PREFER_RECOMPUTE], False),
    ([MUST_SAVE, MUST_SAVE], False),  # equal MUSTs are no conflict
    ([PREFER_RECOMPUTE, PREFER_SAVE, PREFER_RECOMPUTE], True),
]


def _nested(answers: list[Any], body: Any) -> Any:
    if not answers:
        return body()
    with cg.save_recompute_policy(_answer(answers[0], f"p{len(answers)}")):
        return _nested(answers[1:], body)


@pytest.mark.parametrize(("answers", "recomputed"), STACKS, ids=[str(a) for a, _ in STACKS])
def test_policy_stack_resolution(answers: list[Any], recomputed: bool) -> None:
    x = leaf(3, 4)
    y = _nested(answers, lambda: counted_exp(x.sin()).cos())  # cos saves counted_exp's output
    assert CALLS["counted_exp"] == 1
    y.sum().backward()
    assert CALLS["counted_exp"] == (2 if recomputed else 1)
    torch.testing.assert_close(
        x.grad, _eager_grad(lambda z: counted_exp(z.sin()).cos(), (3, 4))[0], rtol=0, atol=0
    )


def test_inner_policy_applies_only_inside_its_block() -> None:
    x = leaf(3, 4)
    with cg.save_recompute_policy(_answer(PREFER_RECOMPUTE, "outer")):
        with cg.save_recompute_policy(_answer(PREFER_SAVE, "inner")):
            a = counted(x)  # kept (inner PREFER_SAVE replaces outer PREFER_RECOMPUTE)
        b = counted(x * 2)  # recomputed (outer only)
        y = a.sin() + b.sin()  # sin saves a and b
    del a, b
    y.sum().backward()
    assert CALLS["counted"] == 3


@pytest.mark.parametrize(
    ("policy", "tag", "recomputed"),
    [
        ("recompute_all", True, False),
        ("recompute_all", CheckpointPolicy.MUST_SAVE, False),
        (const_policy(MUST_RECOMPUTE, "force"), True, False),  # tags override op-level answers
        ("must_save_all", False, True),
        ("must_save_all", CheckpointPolicy.MUST_RECOMPUTE, True),
        ("recompute_all", CheckpointPolicy.PREFER_SAVE, False),
    ],
)
def test_tag_overrides_policy(policy: Any, tag: Any, recomputed: bool) -> None:
    x = leaf(3, 4)
    with cg.save_recompute_policy(policy):
        a = counted_exp(x.sin())
        out = cg.tag_with_policy(a, tag)
        y = a.cos()
    assert out is None or out is a
    del a, out
    y.sum().backward()
    assert CALLS["counted_exp"] == (2 if recomputed else 1)


def test_tag_in_inner_block_applies_to_region() -> None:
    x = leaf(3, 4)
    with cg.save_recompute_policy("recompute_all"):
        with cg.save_recompute_policy("recompute_all"):
            a = counted_exp(x)
            cg.tag_with_policy(a, True)
        y = a.cos()
    y.sum().backward()
    assert CALLS["counted_exp"] == 1


# --------------------------------------------------------------------------- policy calls and ctx


class _Recorder:
    """A policy recording every call; answers PREFER_RECOMPUTE."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.ctx: list[dict[str, Any]] = []

    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((str(op), ctx.op_index))
        self.ctx.append(
            {
                "region": ctx.region,
                "out_bytes": ctx.out_bytes,
                "kept_bytes": ctx.kept_bytes,
                "is_random": ctx.is_random,
                "is_inplace": ctx.is_inplace,
                "module_path": ctx.module_path,
                "flops": ctx.flops,
            }
        )
        return PREFER_RECOMPUTE


def test_policy_called_once_per_op_never_in_backward() -> None:
    rec = _Recorder()
    x = leaf(3, 4)
    with cg.save_recompute_policy(rec):
        y = x.sin().cos().exp()
    assert [op for op, _ in rec.calls] == [
        "aten.sin.default",
        "aten.cos.default",
        "aten.exp.default",
    ]
    assert [i for _, i in rec.calls] == [0, 1, 2]
    y.sum().backward()  # recomputes sin and cos: no policy call
    assert len(rec.calls) == 3


def test_ctx_flops_of_matmul_and_attention() -> None:
    """``ctx.flops`` uses torch's flop counter, and the attention formula for the CPU
    flash-attention kernel, which has no registered formula."""
    rec = _Recorder()
    q = leaf(2, 4, 16, 8)
    w = leaf(8, 8, seed=1)
    with cg.save_recompute_policy(rec):
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        (a @ w).sum()
    flops = {op: c["flops"] for (op, _), c in zip(rec.calls, rec.ctx, strict=True)}
    b, h, t, d = q.shape
    assert flops["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 2 * (
        2 * b * h * t * t * d
    )
    assert flops["aten.mm.default"] == 2 * (b * h * t) * d * d
    assert flops["aten.sum.default"] == 0


def test_every_policy_of_the_stack_called_once_per_op() -> None:
    outer, inner = _Recorder(), _Recorder()
    x = leaf(3, 4)
    with cg.save_recompute_policy(outer):
        h = x.sin()
        with cg.save_recompute_policy(inner):
            h = h.cos().tanh()
        y = h.exp()
    assert [op for op, _ in outer.calls] == [
        "aten.sin.default",
        "aten.cos.default",
        "aten.tanh.default",
        "aten.exp.default",
    ]
    assert [op for op, _ in inner.calls] == ["aten.cos.default", "aten.tanh.default"]
    assert [i for _, i in inner.calls] == [1, 2]
    y.sum().backward()
    assert len(outer.calls) == 4 and len(inner.calls) == 2


def test_region_is_the_same_object_at_every_depth() -> None:
    rec = _Recorder()
    with cg.save_recompute_policy("recompute_all") as r1:
        leaf(3).sin()
        with cg.save_recompute_policy(rec) as r2, cg.save_recompute_policy("must_save_all") as r3:
            leaf(3).cos()
    assert r1 is r2 is r3
    assert rec.ctx[0]["region"] is r1
    with cg.save_recompute_policy("recompute_all") as other:
        pass
    assert other is not r1


def test_ctx_attributes() -> None:
    rec = _Recorder()
    x = leaf(3, 4)
    with cg.save_recompute_policy(rec):
        a = x.sin()  # 0
        a.mul_(2)  # 1: in-place
        b = torch.rand_like(a)  # 2: random
        c = (a * b).sum()  # 3, 4
    assert [op for op, _ in rec.calls][:3] == [
        "aten.sin.default",
        "aten.mul_.Tensor",
        "aten.rand_like.default",
    ]
    assert rec.ctx[0]["out_bytes"] == 3 * 4 * 8
    assert rec.ctx[4]["out_bytes"] == 8
    assert [c["is_inplace"] for c in rec.ctx] == [False, True, False, False, False]
    assert [c["is_random"] for c in rec.ctx] == [False, False, True, False, False]
    assert all(c["module_path"] == "" for c in rec.ctx)
    assert all(isinstance(c["flops"], int) and c["flops"] >= 0 for c in rec.ctx)
    c.backward()


def test_ctx_flags_for_dropout_chain() -> None:
    rec = _Recorder()
    x = leaf(3, 4)
    with cg.save_recompute_policy(rec):
        y = torch.nn.functional.dropout(x, 0.5, training=True)
    flags = {
        op: (c["is_random"], c["is_inplace"]) for (op, _), c in zip(rec.calls, rec.ctx, strict=True)
    }
    assert flags["aten.empty_like.default"] == (False, False)
    assert flags["aten.bernoulli_.float"] == (True, True)
    assert flags["aten.div_.Scalar"] == (False, True)
    assert flags["aten.mul.Tensor"] == (False, False)
    y.sum().backward()


def test_ctx_kept_bytes_grows_with_kept_outputs() -> None:
    seen: list[int] = []

    def keep_all(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(ctx.kept_bytes)
        return MUST_SAVE

    x = leaf(3, 4)
    with cg.save_recompute_policy(keep_all):
        x.sin().cos().exp()
    assert seen[0] < seen[1] < seen[2]
    assert seen[2] - seen[1] == seen[1] - seen[0] == 3 * 4 * 8


def test_ctx_module_path() -> None:
    rec = _Recorder()
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("first", nn.Linear(4, 4).double())
    model.add_module("inner", nn.Sequential(nn.Tanh(), nn.Linear(4, 2).double()))
    x = leaf(3, 4)
    with cg.save_recompute_policy(rec):
        y = model(x).sin()
    paths = [(op, c["module_path"]) for (op, _), c in zip(rec.calls, rec.ctx, strict=True)]
    assert ("aten.addmm.default", "first") in paths
    assert ("aten.tanh.default", "inner.0") in paths
    assert ("aten.addmm.default", "inner.1") in paths
    assert paths[-1] == ("aten.sin.default", "")
    y.sum().backward()


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """An outer mode, as a user's op counter or profiler would be."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_forward_runs_no_op_of_its_own_under_outer_modes(policy: str) -> None:
    """The engine's bookkeeping (generator states, keeping values) is invisible to modes
    around the region: the forward runs exactly the program's ops."""
    q = leaf(1, 2, 8, 4)

    def program() -> torch.Tensor:
        h = q
        for _ in range(3):  # random ops that draw nothing: their states are compared
            h = torch.nn.functional.scaled_dot_product_attention(h, h, h).sin()
        return h.sum()

    with _OpLog() as plain:
        program()
    with _OpLog() as logged, cg.save_recompute_policy(policy):
        program()
    assert logged.ops == plain.ops


def test_memoized_flops_follow_shapes_and_arguments() -> None:
    """See Note [Memoized FLOP formulas]: a repeated call reads the memo, and a call with
    other shapes or other non-tensor arguments gets its own formula's answer."""
    from torch.utils.flop_counter import flop_registry

    from ckpt_graph.engine import flops

    aten = torch.ops.aten
    flops.FLOPS_MEMO.clear()
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    first = flops.estimate_flops(aten.mm.default, a @ b, (a, b), {})
    assert first == 2 * 4 * 8 * 16 and len(flops.FLOPS_MEMO) == 1
    assert flops.estimate_flops(aten.mm.default, a @ b, (a, b), {}) == first
    assert len(flops.FLOPS_MEMO) == 1  # the second call was a hit
    c = torch.randn(8, 3)
    assert flops.estimate_flops(aten.mm.default, a @ c, (a, c), {}) == 2 * 4 * 8 * 3
    x, w = torch.randn(1, 2, 9, 9), torch.randn(4, 2, 3, 3)
    args = [x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1]
    out = aten.convolution.default(*args)
    formula = flop_registry[aten.convolution]
    want = int(formula(*args, out_val=out))
    assert flops.estimate_flops(aten.convolution.default, out, tuple(args), {}) == want
    strided = [x, w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1]
    out2 = aten.convolution.default(*strided)
    got = flops.estimate_flops(aten.convolution.default, out2, tuple(strided), {})
    assert got == int(formula(*strided, out_val=out2)) != want
    flops.FLOPS_MEMO.clear()
    out3 = torch.empty(2, 2)  # formulas read shapes: no product needs computing
    for n in range(flops.FLOPS_MEMO_SIZE + 5):  # bounded: cleared when full
        left, right = torch.empty(2, n + 1), torch.empty(n + 1, 2)  # a new shape each time
        assert flops.estimate_flops(aten.mm.default, out3, (left, right), {}) == 8 * (n + 1)
    assert len(flops.FLOPS_MEMO) <= flops.FLOPS_MEMO_SIZE
