"""Kept values live no longer than what reads them.

See Note [Kept values live no longer than in eager] in ckpt_graph/engine/kept_lifetime.py.
Each test checks which kept values the region still holds while it records, and the
gradients against eager, bitwise.
"""

from __future__ import annotations

from typing import Any

import torch
from models import leaf

import ckpt_graph as cg
from ckpt_graph.engine import graph


def _eager_grad(fn: Any, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    fn(x).sum().backward()
    assert x.grad is not None
    return x.grad


def test_a_kept_value_nothing_reads_is_freed_when_the_program_drops_it() -> None:
    x = leaf(16)
    with cg.save_recompute_policy("must_save_all") as region:
        a = x * 2  # mul by a number saves nothing; relu saves its own output
        b = a.relu()
        h = region.lookup(a)
        assert h is not None and h.value is not None  # the program still holds it
        del a
        assert h.value is None and h.reason is graph.POLICY  # still decided kept
        hb = region.lookup(b)
        y = b.sum()
    assert hb is not None and hb.value is not None  # saved by relu: held into backward
    assert region.kept_bytes == 2 * 128 + 8  # kept_bytes counts the decisions (float64)
    y.backward()
    torch.testing.assert_close(x.grad, _eager_grad(lambda t: (t * 2).relu(), x), rtol=0, atol=0)


def test_a_saved_kept_value_stays_after_the_program_drops_it() -> None:
    x = leaf(16)
    with cg.save_recompute_policy("must_save_all") as region:
        a = x * 2
        y = a.sin()  # saves a
        h = region.lookup(a)
        del a
        assert h is not None and h.value is not None and h.saved_refs == 1
    y.sum().backward()
    torch.testing.assert_close(x.grad, _eager_grad(lambda t: (t * 2).sin(), x), rtol=0, atol=0)


def test_a_kept_value_a_recomputation_reads_stays() -> None:
    x = leaf(16)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t * 2 * 3).sin()

    with cg.save_recompute_policy("recompute_all") as region:
        a = x * 2
        cg.tag_with_policy(a, True)
        b = a * 3  # recomputed from a; sin saves b
        y = b.sin()
        h = region.lookup(a)
        del a, b
        assert h is not None and h.value is not None and h.recompute_input
        assert h.saved_refs == 0
    y.sum().backward()
    torch.testing.assert_close(x.grad, _eager_grad(fn, x), rtol=0, atol=0)


def test_a_graph_dropped_during_the_forward_frees_what_only_it_saved() -> None:
    x = leaf(16)
    with cg.save_recompute_policy("must_save_all") as region:
        a = x * 2
        t = a.sin()  # saves a
        h = region.lookup(a)
        del a
        assert h is not None and h.value is not None
        del t  # its graph, and the saved a, go: nothing reads a any more
        assert h.saved_refs == 0 and h.value is None
        y = (x * 3).relu()
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0) * (x > 0), rtol=0, atol=0)


def test_a_kept_value_used_only_by_kept_ops_is_overwritten_without_a_copy() -> None:
    x = leaf(16)

    def fn(t: torch.Tensor) -> torch.Tensor:
        a = t * 2
        c = a * 3  # kept: its op never runs again, so it does not need the old a
        a.relu_()
        return a + c

    with cg.save_recompute_policy("must_save_all") as region:
        y = fn(x)
    mul, mul2, relu_ = region.nodes[:3]
    old, new = mul.outputs[0], relu_.outputs[0]
    assert old is not None and new is not None and mul2.inputs[0] is old
    assert old.value is None and not old.copied  # overwritten as is: no copy of a
    assert new.reason is graph.INPLACE_ON_KEPT
    y.sum().backward()
    torch.testing.assert_close(x.grad, _eager_grad(fn, x), rtol=0, atol=0)


def test_a_tag_to_recompute_after_the_inputs_were_freed_recomputes_them_too() -> None:
    x = leaf(16)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t * 2).relu().sin()

    with cg.save_recompute_policy("must_save_all") as region:
        a = (x * 2).relu()  # x * 2 is dropped at once: freed
        first = region.nodes[0].outputs[0]
        assert first is not None and first.value is None
        cg.tag_with_policy(a, False)
        y = a.sin()
        del a
    h = region.nodes[1].outputs[0]
    assert h is not None and h.reason is None and first.reason is None  # both recomputed
    y.sum().backward()
    assert region.nodes[0].realized == 1 and region.nodes[1].realized == 1
    torch.testing.assert_close(x.grad, _eager_grad(fn, x), rtol=0, atol=0)


def test_a_tag_to_recompute_a_value_whose_freed_input_the_engine_kept_keeps_it() -> None:
    x = leaf(16)

    def fn(t: torch.Tensor) -> torch.Tensor:
        a = t * 2
        a.mul_(3)  # a's new version is kept by the engine (INPLACE_ON_KEPT)
        return a.relu()

    with cg.save_recompute_policy("must_save_all") as region:
        b = fn(x)  # a is dropped inside fn: freed
        cg.tag_with_policy(b, False)
        y = b.sin()
    h = region.lookup(b)
    assert h is not None and h.reason is graph.INPUTS_FREED and h.value is not None
    y.sum().backward()
    torch.testing.assert_close(x.grad, _eager_grad(lambda t: fn(t).sin(), x), rtol=0, atol=0)


def test_the_last_write_to_a_live_buffer_stays_for_rebase() -> None:
    x = leaf(3, 4)

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = t.sin()
        y[0].mul_(3)  # the written view is dropped at once; y stays
        return y.cos()

    with cg.save_recompute_policy("must_save_all") as region:
        out = fn(x)
    (h,) = region.nodes[-1].inputs
    assert region.nodes[h.node_index].info.name == "aten.as_strided.default"
    out.sum().backward()
    torch.testing.assert_close(x.grad, _eager_grad(fn, x), rtol=0, atol=0)


def test_region_exit_ends_the_watch() -> None:
    x = leaf(16)
    with cg.save_recompute_policy("must_save_all") as region:
        a = x * 2
        y = a.relu()
        assert len(region.recording.watched) == 2
    assert region.recording.watched == []
    h = region.lookup(a)
    assert h is not None and h.value is None  # nothing reads it: freed at the exit
    del a
    y.sum().backward()


def test_freeing_on_drop_goes_below_the_programs_torch_function_modes() -> None:
    """The drop callback runs wherever the program drops a tensor: a torch function mode
    that logs calls (DebugMode renders each storage element by element, which made a test
    step under it take minutes) sees none of the engine's own calls there."""
    seen: list[str] = []

    class Log(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = leaf(16)
    with cg.save_recompute_policy("must_save_all") as region:
        w = x * 3
        w.mul_(2)  # an in-place write: the region now follows storages' histories
        a = x * 2
        b = a.relu()
        h = region.lookup(a)
        with Log():
            del a
        assert h is not None and h.value is None  # freed, as without the mode
        y = b.sum() + w.sum()
    assert seen == []
    y.backward()
    want = _eager_grad(lambda t: (t * 2).relu() + (t * 3).mul_(2), x)
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)
