"""Random ops run again in backward with the generator states of the forward (Note [RNG
replay]).

Gradients under checkpointing equal a run without it, bitwise (DESIGN.md §3); the shared
setup is in ``bitwise_cases.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from bitwise_cases import (
    POLICIES,
    _transient_values,  # noqa: F401 (an autouse fixture: it applies here)
)
from models import check, leaf

import ckpt_graph as cg

# --------------------------------------------------------------------------- random ops


def _dropout(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (F.dropout(x.sin(), 0.5, training=True) * w).cos()


def _dropout_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.dropout(x.exp(), 0.3, training=True)
    return F.dropout(h * w, 0.6, training=True).sin()


def _multinomial(
    x: torch.Tensor, w: torch.Tensor, g: torch.Generator | None = None
) -> torch.Tensor:
    probs = x.detach().abs() + 0.1
    idx = torch.multinomial(probs, 3, replacement=True, generator=g)
    return (x.gather(1, idx) * w[:, :3]).sin()


def _bernoulli(x: torch.Tensor, w: torch.Tensor, g: torch.Generator | None = None) -> torch.Tensor:
    mask = torch.bernoulli(torch.sigmoid(x.detach()), generator=g)
    return (x * mask * w).sin()


def _bernoulli_inplace(
    x: torch.Tensor, w: torch.Tensor, g: torch.Generator | None = None
) -> torch.Tensor:
    mask = torch.empty_like(x).bernoulli_(0.4, generator=g)
    return (x.exp() * mask * w).sin()


def _randn_gen(x: torch.Tensor, w: torch.Tensor, g: torch.Generator | None = None) -> torch.Tensor:
    return (x * torch.randn(x.shape, generator=g, dtype=x.dtype) * w).sin()


def _normal_(x: torch.Tensor, w: torch.Tensor, g: torch.Generator | None = None) -> torch.Tensor:
    noise = torch.empty_like(x).normal_(0, 2, generator=g)
    return (x.sin() * noise + w).exp()


RANDOM_CASES: dict[str, Callable[..., torch.Tensor]] = {
    "dropout": _dropout,
    "dropout_twice": _dropout_twice,
    "randn": lambda x, w: (x * torch.randn(3, 4, dtype=x.dtype) * w).sin(),
    "rand_like": lambda x, w: (x.cos() * torch.rand_like(x) * w).sin(),
    "randint_like": lambda x, w: (x * torch.randint_like(x, 0, 5) * w).sin(),
    "randperm": lambda x, w: (x[:, torch.randperm(4)] * w).sin(),
    "multinomial": _multinomial,
    "bernoulli": _bernoulli,
    "bernoulli_": _bernoulli_inplace,
    "randn_default_gen": _randn_gen,
    "normal_": _normal_,
}
GENERATOR_CASES = ["multinomial", "bernoulli", "bernoulli_", "randn_default_gen", "normal_"]


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
@pytest.mark.parametrize("name", list(RANDOM_CASES))
def test_random_ops(name: str, policy: Any) -> None:
    # RNG state after backward is compared by check(): recompute must not advance the stream.
    ref, _got = check(RANDOM_CASES[name], [leaf(3, 4), leaf(3, 4, seed=2)], policy)
    # Also compare with a different seed: the mask really depends on the stream.
    if name != "randperm":
        other = check(RANDOM_CASES[name], [leaf(3, 4), leaf(3, 4, seed=2)], policy, seed=1)[0]
        assert not torch.equal(other.outputs[0], ref.outputs[0])


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
@pytest.mark.parametrize("name", GENERATOR_CASES)
def test_random_ops_explicit_generator(name: str, policy: Any) -> None:
    fn = RANDOM_CASES[name]
    # check() compares the explicit generator's state after backward too.
    check(fn, [leaf(3, 4), leaf(3, 4, seed=2), torch.Generator().manual_seed(5)], policy)


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_random_op_between_regions_sees_user_stream(policy: str) -> None:
    # Backward of the first region (recomputing its randn) must not shift the stream that a
    # random op running after that backward sees.
    def fn(scope: Any, x: torch.Tensor) -> Any:
        with scope():
            a = (x * torch.randn(3, 4, dtype=x.dtype)).sin()
        a.sum().backward()
        with scope():
            b = (x * torch.rand(3, 4, dtype=x.dtype)).cos()
        return b

    check(fn, [leaf(3, 4)], policy, scoped=True)


def _generator_used_between(scope: Any, x: torch.Tensor, g: torch.Generator) -> Any:
    with scope():
        a = (x * torch.rand(3, 4, generator=g, dtype=x.dtype)).sin()
    between = torch.rand(2, generator=g, dtype=x.dtype)  # advances g before backward
    return a, between


def _keep_every_other(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return ctx.op_index % 2 == 0


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_explicit_generator_advanced_between_forward_and_backward(policy: Any) -> None:
    check(
        _generator_used_between, [leaf(3, 4), torch.Generator().manual_seed(3)], policy, scoped=True
    )


def test_random_ops_some_kept_some_recomputed() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x.exp(), 0.3)
        h = F.dropout(h * w, 0.5) + torch.rand_like(h)
        return (F.dropout(h.sin(), 0.2) * torch.randn(3, 4, dtype=h.dtype)).cos()

    check(fn, [leaf(3, 4), leaf(3, 4, seed=2)], _keep_every_other)


def _sdpa_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.reshape(1, 1, 3, 4) * w.reshape(1, 1, 3, 4)
    for _ in range(6):  # random ops (dropout_p is an argument) that draw nothing
        h = F.scaled_dot_product_attention(h, h, h).sin()
    return h.reshape(3, 4)


def test_random_ops_that_draw_nothing_share_one_generator_state() -> None:
    _, got = check(_sdpa_chain, [leaf(3, 4), leaf(3, 4, seed=2)], "recompute_all")
    assert got.region is not None
    states = [n.rng[1] for n in got.region.nodes if n.rng is not None]
    assert len(states) == 0  # released with the graph after backward
    x, w = leaf(3, 4), leaf(3, 4, seed=2)
    with cg.save_recompute_policy("recompute_all") as region:
        y = _sdpa_chain(x, w)
    states = [n.rng[1] for n in region.nodes if n.rng is not None]
    assert len(states) == 6 and len({id(s) for s in states}) == 1
    assert region.summary().rng_state_bytes == states[0].nbytes
    y.sum().backward()


def test_random_ops_that_draw_keep_their_own_states() -> None:
    x = leaf(3, 4)
    with cg.save_recompute_policy("recompute_all") as region:
        y = F.dropout(F.dropout(x, 0.3).exp(), 0.3)
    states = [n.rng[1] for n in region.nodes if n.rng is not None]
    assert len(states) == 2 and not torch.equal(states[0], states[1])
    y.sum().backward()


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_random_op_in_inner_block(policy: Any) -> None:
    def fn(scope: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with scope() as region:
            h = F.dropout(x.exp(), 0.4)
            inner = (
                cg.save_recompute_policy("recompute_all")
                if region is not None
                else contextlib.nullcontext()
            )
            with inner:
                h = F.dropout(h * w, 0.4).sin()
            return (F.dropout(h, 0.4) * x).tanh()

    check(fn, [leaf(3, 4), leaf(3, 4, seed=2)], policy, scoped=True)
