"""A tag that makes a saved kept value recomputed keeps what its recomputation reads.

``tag_with_policy(v, False)`` on a kept value ``v`` that a saved tensor already reads (or a
needed recomputation) makes ``v`` needed at once. ``need`` asked whether ``v``'s producer
counted in its inputs' ``recompute_readers`` by all its outputs, ``v`` included, so it
counted nothing, and the kept inputs ``a``, ``b`` of ``v = f(a, b)`` were freed when the
program dropped them: backward raised "the kept value ... was already released" when it
recomputed ``v``. Now ``Region.tag`` calls ``need`` while ``v`` is still kept, so only the
producer's other outputs can say it counts already (Note [Kept values live no longer than in
eager], rule 1). Each test compares gradients with eager, bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import leaf

import ckpt_graph as cg
from ckpt_graph import policies
from ckpt_graph.memory import measure

pytestmark = pytest.mark.usefixtures("one_thread")


def _tag(t: torch.Tensor, on: bool) -> None:
    if on:
        cg.tag_with_policy(t, False)


# Each program keeps every value (the region's policy), tags values already saved (or read
# by a needed recomputation) to be recomputed, and drops the kept values their
# recomputation reads before backward. ``on`` is False for the eager run.
def _add(x: torch.Tensor, on: bool) -> torch.Tensor:
    a, b = x * 2, x * 3  # neither saves its input
    v = a + b  # add saves nothing: only the tag's recomputation reads a and b
    y = v.sin()  # saves v
    _tag(v, on)
    del a, b, v
    return y


def _several_readers(x: torch.Tensor, on: bool) -> torch.Tensor:
    a, b = x * 2, x * 3
    v = a + b
    y = v.sin() + v.cos() + v.exp()
    _tag(v, on)
    del a, b, v
    return y


def _two_tags_one_input(x: torch.Tensor, on: bool) -> torch.Tensor:
    a, b = x * 2, x * 3
    v, w = a + b, a - b
    y = v.sin() * w.cos()
    _tag(v, on)
    _tag(w, on)
    del a, b, v, w
    return y


def _chain_tagged_last_to_first(x: torch.Tensor, on: bool) -> torch.Tensor:
    a = x * 2
    b = a + 1
    c = b * 3
    v = c + a
    y = v.sin()
    _tag(v, on)  # then its kept input c, then c's kept input b: each needed at once
    _tag(c, on)
    _tag(b, on)
    del a, b, c, v
    return y


def _views_as_inputs(x: torch.Tensor, on: bool) -> torch.Tensor:
    a = (x * 2).view(8, 8)
    b = a.t()
    v = a + b
    y = v.sin()
    _tag(v, on)
    del a, b, v
    return y.reshape(-1)


def _view_tagged(x: torch.Tensor, on: bool) -> torch.Tensor:
    a, b = x * 2, x * 3
    v = (a + b).view(8, 8)
    y = v.sin()
    _tag(v, on)
    del a, b, v
    return y.reshape(-1)


def _split_outputs(x: torch.Tensor, on: bool) -> torch.Tensor:
    a, b = x * 2, x * 3
    v = a + b
    p, q = v.split(32)  # one op node, two outputs, both saved
    y = p.sin() + q.cos()
    _tag(p, on)
    _tag(q, on)
    del a, b, v, p, q
    return y


def _graph_dropped(x: torch.Tensor, on: bool) -> torch.Tensor:
    a, b = x * 2, x * 3
    v = a + b
    y = v.sin()
    t = v.cos()  # a second saved tensor of v, dropped with its graph during the forward
    _tag(v, on)
    del t, a, b, v
    return y


def _tagged_back_and_forth(x: torch.Tensor, on: bool) -> torch.Tensor:
    a, b = x * 2, x * 3
    v = a + b
    y = v.sin()
    if on:
        cg.tag_with_policy(v, False)
        cg.tag_with_policy(v, True)  # unneed: a and b read by nothing
        cg.tag_with_policy(v, False)
    del a, b, v
    return y


def _needed_by_a_recomputation(x: torch.Tensor, on: bool) -> torch.Tensor:
    c = x * 2
    a = c + 1
    w = a * 3
    _tag(w, on)  # recomputed from a; sin saves w: a is read by a needed recomputation
    y = w.sin()
    _tag(a, on)  # a needed (not saved): recomputing it reads c
    del c, a, w
    return y


def _input_saves_itself(x: torch.Tensor, on: bool) -> torch.Tensor:
    a = x.exp()  # exp saves its output a; b is read by v's recomputation only
    b = x * 3
    v = a + b
    y = v.sin()
    _tag(v, on)
    del a, b, v
    return y


def _inputs_written_in_place(x: torch.Tensor, on: bool) -> torch.Tensor:
    a, b = x * 2, x * 3
    v = a + b
    y = v.sin()
    _tag(v, on)
    a.mul_(5)  # the old values must be copied: v's recomputation reads them
    b.add_(1)
    return y + a.sum() + b.sum()


_PROGRAMS = [
    _add,
    _several_readers,
    _two_tags_one_input,
    _chain_tagged_last_to_first,
    _views_as_inputs,
    _view_tagged,
    _split_outputs,
    _graph_dropped,
    _tagged_back_and_forth,
    _needed_by_a_recomputation,
    _input_saves_itself,
    _inputs_written_in_place,
]


def _keep_every_output(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return True


def _eager_grad(program: Callable[[torch.Tensor, bool], torch.Tensor]) -> torch.Tensor:
    x = leaf(64)
    program(x, False).sum().backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("program", _PROGRAMS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("policy", ["must_save_all", _keep_every_output], ids=["name", "fn"])
def test_a_tag_after_the_save_keeps_the_inputs_of_the_recomputation(
    program: Callable[[torch.Tensor, bool], torch.Tensor], policy: Any
) -> None:
    x = leaf(64)
    with cg.save_recompute_policy(policy):
        y = program(x, True)
    y.sum().backward()
    torch.testing.assert_close(x.grad, _eager_grad(program), rtol=0, atol=0)


@pytest.mark.parametrize(
    "program",
    [_add, _split_outputs, _needed_by_a_recomputation],
    ids=lambda f: f.__name__.strip("_"),
)
def test_the_module_level_checkpoint(program: Callable[[torch.Tensor, bool], torch.Tensor]) -> None:
    x = leaf(64)
    y = cg.checkpoint(program, x, True, policy="must_save_all")
    y.sum().backward()
    torch.testing.assert_close(x.grad, _eager_grad(program), rtol=0, atol=0)


def test_a_memory_budget_that_keeps_the_inputs() -> None:
    # Under memory_budget(1.0) the plan keeps x * 2 and the view below; before, tagging v
    # freed them (the chain and views programs raised).
    for program in (_chain_tagged_last_to_first, _views_as_inputs, _input_saves_itself):
        x = leaf(64)
        with cg.save_recompute_policy(policies.memory_budget(1.0)):
            y = program(x, True)
        y.sum().backward()
        torch.testing.assert_close(x.grad, _eager_grad(program), rtol=0, atol=0)


def test_the_inputs_stay_while_the_tagged_value_is_saved_and_go_with_it() -> None:
    x = leaf(64)
    with cg.save_recompute_policy("must_save_all") as region:
        a, b = x * 2, x * 3
        v = a + b
        y = v.sin()
        hv, ha, hb = region.lookup(v), region.lookup(a), region.lookup(b)
        assert hv is not None and ha is not None and hb is not None
        cg.tag_with_policy(v, False)
        assert hv.value is None and hv.saved_refs == 1
        assert ha.recompute_readers == 1 and hb.recompute_readers == 1
        del a, b, v
        assert ha.value is not None and hb.value is not None  # v's recomputation reads them
        t = y
        del y
        assert ha.value is not None  # the graph's saved tensor of v still needs them
        y = t.sum()
        del t
    y.backward()
    assert region.released and ha.value is None and hb.value is None


def test_a_graph_dropped_during_the_forward_lets_the_inputs_go() -> None:
    x = leaf(64)
    with cg.save_recompute_policy("must_save_all") as region:
        a, b = x * 2, x * 3
        v = a + b
        y = v.sin()
        ha, hb = region.lookup(a), region.lookup(b)
        assert ha is not None and hb is not None
        cg.tag_with_policy(v, False)
        del a, b, v
        assert ha.value is not None and hb.value is not None
        del y  # its graph held the only saved tensor of v: unneed frees a and b
        assert ha.recompute_readers == 0 and hb.recompute_readers == 0
        assert ha.value is None and hb.value is None
        (x * 4).sum()


def test_a_tag_after_the_save_peaks_as_one_before_it() -> None:
    # The tag trades v for its inputs a and b: held from the tag to the backward that
    # recomputes v, as when the tag comes before the save (already counted by the pack hook).
    x0 = leaf(1 << 15, grad=False)
    size = x0.nbytes  # 256 KiB

    def forward(x: torch.Tensor, tag: str | None) -> torch.Tensor:
        a, b = x * 2, x * 3
        v = a + b
        if tag == "before":
            cg.tag_with_policy(v, False)
        y = v.sin()
        if tag == "after":
            cg.tag_with_policy(v, False)
        return y

    def step(tag: str | None) -> None:
        x = x0.clone().requires_grad_(True)
        if tag is None:
            y = forward(x, tag)
        else:
            with cg.save_recompute_policy("must_save_all"):
                y = forward(x, tag)
        y.sum().backward()

    step("after")
    eager = measure(step, None)
    before = measure(step, "before")
    after = measure(step, "after")
    assert after.peak_by_phase == before.peak_by_phase
    assert after.peak_by_phase["forward"] == eager.peak_by_phase["forward"]
    # a and b go when autograd releases sin's saved tensor, after sin's backward ran: two
    # values above eager (measured 2026-11-28: 1,835,040 vs 1,310,752 bytes).
    assert after.peak_bytes == eager.peak_bytes + 2 * size
