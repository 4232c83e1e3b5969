"""Lifetime and state: nothing recorded outlives its use, no cycles, threads, deep graphs.

Liveness is checked with weakrefs while the garbage collector is disabled, so a value kept alive
only by a reference cycle counts as alive. Weakrefs go to tensors and to their storages (a storage
dies only when no alias of it is left, so kept values held as aliases are covered too). Recomputed
values are tracked by the counting custom ops, which keep a weakref to the storage of every output
they produce (``models.LIVE_OUTPUTS``).
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from models import CALLS, LIVE_OUTPUTS, counted, counted_exp, leaf, make_model, run, save_matmuls
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg

POLICIES = ["recompute_all", "must_save_all", save_matmuls]
POLICY_IDS = ["recompute_all", "must_save_all", "save_matmuls"]


_WARM: list[bool] = []


@contextmanager
def gc_disabled() -> Iterator[None]:
    """Disable the cycle collector; once per session, first run regions to finish lazy imports.

    A lazy import that fails inside torch leaves cyclic garbage holding the frames that were
    active, and with them whatever tensors those frames referenced: not the engine's doing.
    """
    if not _WARM:
        for policy in ("recompute_all", "must_save_all"):
            w = leaf(2)
            with cg.save_recompute_policy(policy):
                y = counted(counted_exp(w.sin() * 0.5)).tanh().sum()
            y.backward()
        gc.collect()
        _WARM.append(True)
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _alive(refs: list[weakref.ref[Any]]) -> list[Any]:
    return [r() for r in refs if r() is not None]


def _forward(x: torch.Tensor, policy: Any) -> tuple[torch.Tensor, list[weakref.ref[Any]], Any]:
    """A region whose intermediates are only reachable through autograd / the engine."""
    refs: list[weakref.ref[Any]] = []
    with cg.save_recompute_policy(policy) as region:
        h = x
        for _ in range(3):
            h = counted_exp(h.sin() * 0.5)
            refs += [weakref.ref(h), weakref.ref(h.untyped_storage())]
            h = counted(h).tanh()
            refs += [weakref.ref(h), weakref.ref(h.untyped_storage())]
        out = (h * x).sum()
    return out, refs, region


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_nothing_alive_after_backward(policy: Any) -> None:
    x = leaf(3, 4)
    with gc_disabled():
        out, refs, region = _forward(x, policy)
        out.backward()
        del out
        assert CALLS["counted_exp"] >= 3
        assert not _alive(refs), "intermediate tensors of the region alive after backward"
        assert not _alive(LIVE_OUTPUTS), "recomputed values alive after backward"
        assert region is not None  # the region object itself may live on (introspection)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_nothing_alive_after_dropping_graph_without_backward(policy: Any) -> None:
    x = leaf(3, 4)
    with gc_disabled():
        out, refs, region = _forward(x, policy)
        del out
        assert not _alive(refs)
        assert not _alive(LIVE_OUTPUTS)
        del region


@pytest.mark.parametrize(
    "policy", ["recompute_all", save_matmuls], ids=["recompute_all", "save_matmuls"]
)
def test_recomputed_intermediates_dropped_during_forward(policy: Any) -> None:
    # No op here is a matmul, so save_matmuls recomputes everything too: right after the
    # forward, none of the intermediates may be alive (the graph holds handles, not values).
    x = leaf(3, 4)
    with gc_disabled():
        out, refs, _ = _forward(x, policy)
        assert not _alive(refs)
        assert not _alive(LIVE_OUTPUTS)
        out.backward()


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_region_input_released(policy: Any) -> None:
    # A region input that nobody else holds is released with the graph.
    with gc_disabled():
        x = leaf(3, 4)
        h = x * 2
        ref = weakref.ref(h)
        with cg.save_recompute_policy(policy):
            y = (h.sin() * h).sum()
        del h
        y.backward()
        del y
        assert ref() is None


def test_no_reference_cycles() -> None:
    # Everything the runs create must be freed by reference counting alone (one collection for
    # all policies: a full collection is the slow part).
    model, x = make_model("cnn")
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with gc_disabled():
            for policy in POLICIES:
                res = run(model, [x], policy)
                del res
            gc.garbage.clear()
            gc.collect()
            suspects = [
                o
                for o in gc.garbage
                if isinstance(o, torch.Tensor) or type(o).__module__.startswith("ckpt_graph")
            ]
            assert not suspects, (
                f"{len(suspects)} objects freed only by the cycle collector: {suspects[:5]}"
            )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_region_object_freed_without_cycles() -> None:
    x = leaf(3, 4)
    with gc_disabled():
        out, _, region = _forward(x, "recompute_all")
        out.backward()
        try:
            ref = weakref.ref(region)
        except TypeError:
            pytest.skip("Region does not support weak references")
        del out, region
        assert ref() is None


# --------------------------------------------------------------------------- several regions, threads


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_several_regions_alive_at_once(policy: Any) -> None:
    # Per-layer regions over micro-batches, all forwards before any backward.
    def fn(scope: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Any:
        outs = []
        for mb in x.split(2):
            h = mb
            for w in (w1, w2, w1):
                with scope():
                    h = (h @ w).tanh().exp()
            outs.append(h)
        return outs

    ref = run(fn, [leaf(6, 4), leaf(4, 4, seed=1), leaf(4, 4, seed=2)], None, scoped=True)
    got = run(fn, [leaf(6, 4), leaf(4, 4, seed=1), leaf(4, 4, seed=2)], policy, scoped=True)
    for a, b in zip(ref.grads, got.grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_regions_in_two_threads(policy: Any) -> None:
    barrier = threading.Barrier(2, timeout=30)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    calls: dict[int, int] = {0: 0, 1: 0}

    def counting(k: int) -> Callable[..., Any]:
        def p(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            calls[k] += 1
            if policy == "must_save_all":
                return True
            if policy == "recompute_all":
                return False
            return save_matmuls(ctx, out, op, *args, **kwargs)

        return p

    def worker(k: int) -> None:
        try:
            x, w = leaf(4, 4, seed=10 + k), leaf(4, 4, seed=20 + k)
            with cg.save_recompute_policy(counting(k)):
                h = (x @ w).sin()
                barrier.wait()  # both regions open at once
                h = (h * x).exp()
                barrier.wait()
                y = (h @ w).tanh().sum()
            barrier.wait()
            y.backward()
            results[k] = (x.grad, w.grad)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        x, w = leaf(4, 4, seed=10 + k), leaf(4, 4, seed=20 + k)
        ((((x @ w).sin() * x).exp() @ w).tanh().sum()).backward()
        torch.testing.assert_close(results[k][0], x.grad, rtol=0, atol=0)
        torch.testing.assert_close(results[k][1], w.grad, rtol=0, atol=0)
        assert calls[k] == 7  # mm, sin, mul, exp, mm, tanh, sum: nothing from the other thread


@pytest.mark.parametrize("seed_grad", ["explicit", "implicit"])
def test_backward_inside_open_region_records_nothing(seed_grad: str) -> None:
    calls: list[str] = []

    def counting(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(op))
        return False

    def backward(t: torch.Tensor, g: torch.Tensor) -> None:
        # implicit: torch.autograd.backward makes the seed gradient with ones_like itself
        t.backward(g if seed_grad == "explicit" else None)

    x, w = leaf(3, 4), leaf(3, 4, seed=1)
    other = (w.exp() * w).sum()  # a graph built outside the region
    with cg.save_recompute_policy(counting) as region:
        y = (x.sin() * x).cos().sum()
        ones = torch.ones((), dtype=torch.float64)
        n = len(calls)
        backward(other, ones)  # backward of an outside graph inside the region
        assert calls[n:] == []
        backward(y, ones)  # backward of the region's own graph, while it is still open
        assert calls[n:] == []
        z = x.tanh()  # recording continues afterwards
        assert calls[n:] == ["aten.tanh.default"]
    assert region is not None
    xe, we = leaf(3, 4), leaf(3, 4, seed=1)
    (xe.sin() * xe).cos().sum().backward()
    (we.exp() * we).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, we.grad, rtol=0, atol=0)
    z.sum().backward()


def test_backward_inside_inner_block_of_model_region() -> None:
    # A training step run entirely inside an open region (e.g. a user wrapping the whole loop).
    model, x = make_model("mlp")
    ref_model, _ = make_model("mlp")
    ref_model(x).sum().backward()
    with cg.save_recompute_policy("recompute_all"):
        model(x).sum().backward()
        first = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(first, [p.grad for p in ref_model.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- deep graphs


def test_20000_op_chain_realizes_without_recursion() -> None:
    n = 20_000
    x, xe = leaf(3), leaf(3)
    with cg.save_recompute_policy("recompute_all"):
        h = x
        for _ in range(n):
            h = h.sin()
    h.sum().backward()
    h = xe
    for _ in range(n):
        h = h.sin()
    h.sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)


def test_deep_graph_dropped_without_backward() -> None:
    x = leaf(3)
    with gc_disabled():
        with cg.save_recompute_policy("recompute_all"):
            h = x
            for _ in range(20_000):
                h = h * 1.0001
            last = weakref.ref(h)
        del h
        assert last() is None


def test_module_state_not_global() -> None:
    # Two regions with different policies interleaved: each keeps its own decisions.
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    x = leaf(2, 4)
    with cg.save_recompute_policy("must_save_all"):
        a = counted_exp(lin(x))
    with cg.save_recompute_policy("recompute_all"):
        b = counted_exp(lin(x) * 2)
    loss = a.sum() + b.sum()
    del a, b  # held values are not recomputed (Note [Live forward tensors])
    loss.backward()
    assert CALLS["counted_exp"] == 3, dict(CALLS)  # only b's op recomputed


def _module_state_refs(targets: list[Any]) -> list[str]:
    """Names of ckpt_graph module globals that hold (directly or one container deep) a target."""
    import sys

    ids = {id(t) for t in targets}
    found = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("ckpt_graph") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            items: list[Any] = [value]
            if isinstance(value, dict):
                items += list(value.keys()) + list(value.values())
            elif isinstance(value, (list, tuple, set, frozenset)):
                items += list(value)
            if any(id(i) in ids or isinstance(i, torch.Tensor) for i in items):
                found.append(f"{name}.{attr}")
    return found


def test_no_module_level_state_holds_regions_tensors_or_policies() -> None:
    def my_policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.PREFER_RECOMPUTE

    x = leaf(3, 4)
    with cg.save_recompute_policy(my_policy) as region:
        h = x.sin()
        y = (h * x).exp().sum()
        inside = _module_state_refs([region, my_policy, x, h])
    after_forward = _module_state_refs([region, my_policy, x, h])
    y.backward()
    after_backward = _module_state_refs([region, my_policy, x, h])
    assert inside == after_forward == after_backward == []


def _body(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * x).exp().tanh()


def _eager_grad_of_body() -> torch.Tensor:
    x = leaf(3, 4)
    _body(x).sum().backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_backward_in_another_thread(policy: Any) -> None:
    x = leaf(3, 4)
    with cg.save_recompute_policy(policy):
        y = _body(x).sum()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            y.backward()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    torch.testing.assert_close(x.grad, _eager_grad_of_body(), rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_exception_in_region_body_keeps_graph_usable(policy: Any) -> None:
    x = leaf(3, 4)
    with pytest.raises(ValueError, match="user error"), cg.save_recompute_policy(policy):
        y = _body(x).sum()
        raise ValueError("user error")
    y.backward()  # what was recorded before the exception is still differentiable
    torch.testing.assert_close(x.grad, _eager_grad_of_body(), rtol=0, atol=0)


def test_exception_in_inner_block_pops_its_policy() -> None:
    calls: list[str] = []

    def inner_policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(op))
        return None

    x = leaf(3, 4)
    with cg.save_recompute_policy("recompute_all"):
        h = x.sin()
        with pytest.raises(KeyError), cg.save_recompute_policy(inner_policy):
            h = h * x
            raise KeyError("inner")
        y = h.exp().tanh().sum()  # the inner policy must not see these ops
    assert calls == ["aten.mul.Tensor"]
    y.backward()
    torch.testing.assert_close(x.grad, _eager_grad_of_body(), rtol=0, atol=0)


def test_policy_exception_propagates() -> None:
    def broken(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("policy bug")

    with pytest.raises(ZeroDivisionError, match="policy bug"), cg.save_recompute_policy(broken):
        _body(leaf(3, 4))
    # conftest checks that no dispatch mode or saved-tensor hook is left installed


def test_many_regions_all_freed() -> None:
    x = leaf(3, 4)
    refs = []
    with gc_disabled():
        for _ in range(200):
            with cg.save_recompute_policy("recompute_all") as region:
                y = _body(x).sum()
            y.backward()
            try:
                refs.append(weakref.ref(region))
            except TypeError:
                pytest.skip("Region does not support weak references")
            del region, y
        assert sum(r() is not None for r in refs) == 0


def test_large_fan_out_realized_once() -> None:
    x, xe = leaf(3, 4), leaf(3, 4)
    with cg.save_recompute_policy("recompute_all"):
        a = counted_exp(x)
        y = torch.stack([(a * (i + 1)).sin().sum() for i in range(300)]).sum()
        del a  # a value the program holds is read as it is (Note [Live forward tensors])
    y.backward()
    assert CALLS["counted_exp"] == 2
    ae = counted_exp(xe)
    torch.stack([(ae * (i + 1)).sin().sum() for i in range(300)]).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)
