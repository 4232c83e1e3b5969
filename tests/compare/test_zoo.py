"""Zoo models x policies, and random op chains, against runs without checkpointing.

Every comparison is bitwise (float64 on CPU): outputs, parameter and input gradients, buffers
(BatchNorm running stats, ``num_batches_tracked``) and the RNG state after backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import ZOO, assert_same, leaf, make_model, run, save_matmuls
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg
from ckpt_graph import policies
from ckpt_graph.engine import passes

# name -> (outer policy, {block index: inner policy}, tag block outputs)
CONFIGS: dict[str, tuple[Any, dict[int, Any], bool]] = {
    "recompute_all": ("recompute_all", {}, False),
    "must_save_all": ("must_save_all", {}, False),
    "save_matmuls": (save_matmuls, {}, False),
    "nested_recompute_outer_save_inner": ("recompute_all", {1: "must_save_all"}, False),
    "nested_save_outer_recompute_inner": ("must_save_all", {0: "recompute_all"}, False),
    "nested_matmuls_inner": ("recompute_all", {0: save_matmuls, 1: save_matmuls}, False),
    "nested_two_levels": (save_matmuls, {0: "recompute_all", 1: "must_save_all"}, False),
    "tags_recompute_all": ("recompute_all", {}, True),
    "tags_nested": ("recompute_all", {0: "must_save_all"}, True),
    "builtin_save_matmuls": (policies.save_matmuls(), {}, False),
    "builtin_nested": (
        policies.save_matmuls(),
        {1: policies.save_module_outputs(torch.nn.Linear)},
        False,
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", ZOO)
def test_zoo_matches_eager(name: str, config: str) -> None:
    outer, inner, tags = CONFIGS[config]
    model, x = make_model(name)
    ref = run(model, [x], None)
    model.block_policy = dict(inner)
    model.tag_blocks = tags
    got = run(model, [x], outer)
    assert_same(ref, got)
    assert len(ref.grads) > 3 and all(g is not None for g in ref.grads[1:])


@pytest.mark.parametrize("config", ["recompute_all", "save_matmuls", "tags_nested"])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_float32(name: str, config: str) -> None:
    # CPU kernels are deterministic in float32 too: still bitwise.
    outer, inner, tags = CONFIGS[config]
    model, x = make_model(name, dtype=torch.float32)
    ref = run(model, [x], None)
    model.block_policy = dict(inner)
    model.tag_blocks = tags
    assert_same(ref, run(model, [x], outer))


@pytest.mark.parametrize("name", ZOO)
def test_zoo_two_steps_buffers_and_rng(name: str) -> None:
    # Two training steps in a row: BatchNorm stats and the RNG stream must stay in lockstep.
    model, x = make_model(name)

    def two_steps(scope: Any, m: torch.nn.Module, inp: torch.Tensor) -> torch.Tensor:
        with scope():
            first = m(inp)
        first.sum().backward()
        with scope():
            return m(inp)

    ref = run(two_steps, [model, x], None, scoped=True)
    got = run(two_steps, [model, x], "recompute_all", scoped=True)
    assert_same(ref, got)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_zoo_autocast_bf16(name: str) -> None:
    model, x = make_model(name, dtype=torch.float32)

    def fn(m: torch.nn.Module, inp: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(inp).float()

    ref = run(fn, [model, x], None)
    got = run(fn, [model, x], save_matmuls)
    assert_same(ref, got)


# --------------------------------------------------------------------------- random op chains

Op = Callable[[list[torch.Tensor], int, int], torch.Tensor | None]


def _fresh_inplace(f: Callable[[torch.Tensor, torch.Tensor], Any]) -> Op:
    """An in-place op applied to a non-leaf pool tensor (leaves are skipped)."""

    def op(pool: list[torch.Tensor], i: int, j: int) -> torch.Tensor | None:
        nonleaf = [t for t in pool if not t.is_leaf]
        if not nonleaf:
            return None
        f(nonleaf[i % len(nonleaf)], pool[j % len(pool)])
        return None

    return op


def _unary(f: Callable[[torch.Tensor], torch.Tensor]) -> Op:
    return lambda pool, i, j: f(pool[i % len(pool)])


def _binary(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Op:
    return lambda pool, i, j: f(pool[i % len(pool)], pool[j % len(pool)])


OPS: list[Op] = [
    # unary
    _unary(torch.sin),
    _unary(torch.tanh),
    _unary(torch.sigmoid),
    _unary(lambda t: t.relu()),
    _unary(lambda t: F.gelu(t, approximate="tanh")),
    _unary(lambda t: torch.exp(-t * t)),
    _unary(lambda t: t * 0.5 + 0.25),
    # binary
    _binary(torch.add),
    _binary(torch.mul),
    _binary(lambda a, b: torch.sub(a, b, alpha=0.5)),
    _binary(lambda a, b: a / (1 + b * b)),
    _binary(torch.maximum),
    _binary(lambda a, b: a @ b),
    # views
    _unary(lambda t: t.t()),
    _unary(lambda t: t.unsqueeze(0).transpose(0, 1).squeeze(1)),
    _unary(lambda t: t[1:3].expand(2, 2, 4).reshape(4, 4)),
    _unary(lambda t: t.flip(0)),
    # reductions
    _unary(lambda t: t * t.mean()),
    _unary(lambda t: t.sum(1, keepdim=True) * t),
    _unary(lambda t: t.softmax(1)),
    _unary(lambda t: t / (t.norm() + 1)),
    _unary(lambda t: t.amax(0, keepdim=True) - t),
    _unary(lambda t: t.cumsum(0)),
    # random
    _unary(lambda t: F.dropout(t, 0.3)),
    _unary(lambda t: t * torch.rand_like(t)),
    # multi-output
    _unary(lambda t: torch.cat(t.split([1, 3]), 0).flip(1)),
    _unary(lambda t: t.topk(2, dim=1).values.repeat(1, 2)),
    _unary(lambda t: torch.stack(t.unbind(0)[::-1])),
    _unary(lambda t: t.sort(dim=0).values * t.max(dim=1, keepdim=True).values),
    # in-place (may be rejected by eager autograd: then the checkpointed run must raise too)
    _fresh_inplace(lambda t, o: t.mul_(1.5)),
    _fresh_inplace(lambda t, o: t.add_(o)),
    _fresh_inplace(lambda t, o: t.mul_(o)),
    _fresh_inplace(lambda t, o: t.relu_()),
    _fresh_inplace(lambda t, o: t.sin_()),
    _fresh_inplace(lambda t, o: t[0:2].mul_(2)),
    _fresh_inplace(lambda t, o: t[:, 1].add_(o[:, 2])),
]

steps_st = st.lists(
    st.tuples(st.integers(0, len(OPS) - 1), st.integers(0, 50), st.integers(0, 50)),
    min_size=1,
    max_size=10,
)


def _policy_st(answers: list[Any], names: list[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(names), st.lists(st.sampled_from(answers), min_size=1, max_size=6)
    )


PREFER = [False, None, CheckpointPolicy.PREFER_SAVE, CheckpointPolicy.PREFER_RECOMPUTE]
# Two different MUST answers for one op are an error, so a plan never pairs MUST_RECOMPUTE with
# MUST_SAVE across levels: either the outer policy may force recompute and the inner one only
# prefers, or neither forces recompute.
with_must_recompute = _policy_st([*PREFER, CheckpointPolicy.MUST_RECOMPUTE], ["recompute_all"])
with_must_save = _policy_st([*PREFER, True], ["recompute_all", "must_save_all", save_matmuls])
prefer_only = _policy_st(PREFER, ["recompute_all"])
span = st.tuples(st.integers(0, 10), st.integers(0, 10))
plan_st = st.one_of(
    st.tuples(with_must_recompute, st.none()),
    st.tuples(with_must_save, st.none()),
    st.tuples(with_must_recompute, st.tuples(prefer_only, span)),
    st.tuples(with_must_save, st.tuples(with_must_save, span)),
    st.tuples(prefer_only, st.tuples(with_must_recompute, span)),
)


def _as_policy(p: Any) -> Any:
    if not isinstance(p, list):
        return p
    answers = list(p)

    def by_position(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return answers[ctx.op_index % len(answers)]

    return by_position


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps_st, plan=plan_st, transient=st.booleans())
def test_random_op_chains(
    steps: list[tuple[int, int, int]], plan: tuple[Any, Any], transient: bool
) -> None:
    # ``transient``: let the small values of these programs be transient (Note [Transient values]).
    default = passes.TRANSIENT_MIN_BYTES
    passes.TRANSIENT_MIN_BYTES = 0 if transient else default
    try:
        _random_op_chain(steps, plan)
    finally:
        passes.TRANSIENT_MIN_BYTES = default


def _random_op_chain(steps: list[tuple[int, int, int]], plan: tuple[Any, Any]) -> None:
    outer, inner = plan

    def program(scope: Any, x: torch.Tensor, w: torch.Tensor) -> Any:
        pool = [x, w]
        with scope() as region:
            for k, (op, i, j) in enumerate(steps):
                nested = (
                    region is not None
                    and inner is not None
                    and inner[1][0] <= k < inner[1][0] + inner[1][1]
                )
                if nested:
                    with cg.save_recompute_policy(_as_policy(inner[0])):
                        out = OPS[op](pool, i, j)
                else:
                    out = OPS[op](pool, i, j)
                if out is not None:
                    pool.append(out)
        return tuple(pool[2:]) if len(pool) > 2 else (pool[0] * pool[1],)

    inputs = [leaf(4, 4, seed=3), leaf(4, 4, seed=4)]
    try:
        ref = run(program, inputs, None, scoped=True)
    except RuntimeError as e:
        # Eager autograd rejects the program (e.g. a saved tensor modified in place, an in-place
        # op on a view of a leaf): the checkpointed run must reject it too.
        with pytest.raises(RuntimeError):
            run(program, inputs, _as_policy(outer), scoped=True)
        assert "ckpt_graph" not in str(e)
        return
    got = run(program, inputs, _as_policy(outer), scoped=True)
    assert_same(ref, got)
