"""Errors: API misuse, conflicting policies, version-counter errors, failures during recompute.

Each error is matched by its message: it must name the op / policy / tensor involved. Where eager
autograd rejects a program (a saved tensor modified in place), the test checks that eager raises
too, so the expectation is exactly "same as without checkpointing".
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import CALLS, FRAGILE, const_policy, fragile, leaf, save_matmuls
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg

POLICIES = ["recompute_all", "must_save_all", save_matmuls]
POLICY_IDS = ["recompute_all", "must_save_all", "save_matmuls"]
VERSION_ERROR = "modified by an inplace operation"
OP_RE = r"aten(\.|::)sin"  # how an op may be spelled in a message


# --------------------------------------------------------------------------- API misuse


@pytest.mark.parametrize("name", ["recompute-all", "save_all", "", "RECOMPUTE_ALL"])
def test_unknown_policy_string(name: str) -> None:
    with pytest.raises(ValueError, match="recompute_all") as info, cg.save_recompute_policy(name):
        pass
    assert "must_save_all" in str(info.value)
    assert repr(name) in str(info.value) or name in str(info.value)


def test_unknown_policy_string_function_form() -> None:
    with pytest.raises(ValueError, match="must_save_all"):
        cg.checkpoint(torch.sin, leaf(3), policy="nope")


def test_unknown_policy_string_nested_leaves_outer_region_working() -> None:
    x = leaf(3)
    with cg.save_recompute_policy("recompute_all"):
        h = x.exp()
        with pytest.raises(ValueError, match="recompute_all"):  # noqa: SIM117
            with cg.save_recompute_policy("bogus"):
                pass
        y = h.sin()
    y.sum().backward()
    xe = leaf(3)
    xe.exp().sin().sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    "answer", [3, "MUST_SAVE", 1.0, object()], ids=["int", "str", "float", "object"]
)
def test_policy_returning_bad_type(answer: Any) -> None:
    # A CkptGraphError, not a TypeError: torch turns a TypeError raised under a Python
    # operator into NotImplemented (see Note [Policy stack resolution]).
    policy = const_policy(answer, name="my_bad_policy")
    x = leaf(3)
    for call in (torch.sin, lambda t: t * 2):
        with pytest.raises(cg.CkptGraphError, match="my_bad_policy") as info:  # noqa: SIM117
            with cg.save_recompute_policy(policy):
                call(x)
        assert not isinstance(info.value, TypeError)
    assert re.search(r"aten(\.|::)mul", str(info.value)), str(info.value)


def test_non_callable_policy() -> None:
    with pytest.raises(TypeError):  # noqa: SIM117
        with cg.save_recompute_policy(3):
            pass


def test_context_manager_object_cannot_be_entered_twice() -> None:
    block = cg.save_recompute_policy("recompute_all")
    with block:
        pass
    with pytest.raises((RuntimeError, ValueError), match="twice"), block:
        pass


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_parameter_updated_between_forward_and_backward(policy: Any) -> None:
    # An optimizer step before backward: eager raises (addmm saved the weight), so must the region.
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    x = leaf(3, 4)
    for scope in (contextlib.nullcontext(), cg.save_recompute_policy(policy)):
        with scope:
            y = lin(x).sin().sum()
        with torch.no_grad():
            lin.weight.add_(1)
        with pytest.raises(RuntimeError, match=VERSION_ERROR):
            y.backward()


# --------------------------------------------------------------------------- conflicting MUSTs


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE),
        (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE),
        (CheckpointPolicy.MUST_RECOMPUTE, True),
        (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_CPU_OFFLOAD),
    ],
)
def test_conflicting_must_answers(outer: Any, inner: Any) -> None:
    p_outer = const_policy(outer, "outer_policy_a")
    p_inner = const_policy(inner, "inner_policy_b")
    x = leaf(3)
    with pytest.raises((cg.CkptGraphError, ValueError)) as info:  # noqa: SIM117
        with cg.save_recompute_policy(p_outer):
            with cg.save_recompute_policy(p_inner):
                x.sin()
    msg = str(info.value)
    assert "outer_policy_a" in msg and "inner_policy_b" in msg, msg
    assert re.search(OP_RE, msg), msg


def test_conflicting_must_answers_three_levels_with_abstainer() -> None:
    x = leaf(3)
    with pytest.raises((cg.CkptGraphError, ValueError)) as info:  # noqa: SIM117
        with cg.save_recompute_policy(const_policy(True, "keeper")):
            with cg.save_recompute_policy(const_policy(None, "abstainer")):
                with cg.save_recompute_policy(
                    const_policy(CheckpointPolicy.MUST_RECOMPUTE, "forcer")
                ):
                    x.exp()
    msg = str(info.value)
    assert "keeper" in msg and "forcer" in msg and "abstainer" not in msg, msg


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        (CheckpointPolicy.MUST_SAVE, True),
        ("must_save_all", CheckpointPolicy.MUST_SAVE),
        (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE),
        (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE),
        ("recompute_all", "must_save_all"),
    ],
)
def test_agreeing_or_weaker_answers_do_not_raise(outer: Any, inner: Any) -> None:
    x, xe = leaf(3), leaf(3)
    p_outer = outer if isinstance(outer, str) else const_policy(outer, "outer")
    p_inner = inner if isinstance(inner, str) else const_policy(inner, "inner")
    with cg.save_recompute_policy(p_outer), cg.save_recompute_policy(p_inner):
        y = x.exp().sin()
    y.sum().backward()
    xe.exp().sin().sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)


# --------------------------------------------------------------------------- tags


@pytest.mark.parametrize("value", [True, False, CheckpointPolicy.MUST_SAVE])
def test_tag_outside_region_raises(value: Any) -> None:
    t = leaf(3).exp()
    with pytest.raises((RuntimeError, ValueError), match="region"):
        cg.tag_with_policy(t, value)


def test_tag_after_region_closed_raises() -> None:
    with cg.save_recompute_policy():
        t = leaf(3).exp()
    with pytest.raises((RuntimeError, ValueError), match="region"):
        cg.tag_with_policy(t, True)


# --------------------------------------------------------------------------- inference mode


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_inference_tensor_saved_in_region_raises_like_eager(policy: Any) -> None:
    # Autograd itself rejects saving an inference tensor before any saved-tensor hook runs, so
    # the region cannot turn this into a CkptGraphError (core bug #4: wontfix); it must raise
    # the same clear error as eager and leave no region machinery installed (conftest checks).
    with torch.inference_mode():
        x = torch.randn(3, dtype=torch.float64)
    w = leaf(3)
    with pytest.raises(RuntimeError, match=r"Inference tensors cannot be saved"):
        (x * w).sum().backward()
    with pytest.raises(RuntimeError, match=r"Inference tensors cannot be saved"):  # noqa: SIM117
        with cg.save_recompute_policy(policy):
            (x * w).sin()
    # and the next region works normally
    x2, xe = leaf(3), leaf(3)
    with cg.save_recompute_policy(policy):
        y = (x2.exp() * x2).sin()
    y.sum().backward()
    (xe.exp() * xe).sin().sum().backward()
    torch.testing.assert_close(x2.grad, xe.grad, rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_inference_tensor_input_not_saved_by_autograd(policy: Any) -> None:
    # Eager accepts this (add saves nothing). The region must either give eager's gradients
    # (keeping the inference tensor as a region input) or refuse with a CkptGraphError that says
    # what to do; a raw torch error from inside the engine is neither.
    with torch.inference_mode():
        x = torch.randn(3, dtype=torch.float64)
    w, we = leaf(3), leaf(3)
    (x + we).sin().sum().backward()
    try:
        with cg.save_recompute_policy(policy):
            y = (x + w).sin()  # sin saves x + w, recomputed from x
        y.sum().backward()
    except cg.CkptGraphError as e:
        assert re.search(r"[Ii]nference", str(e)), str(e)
        return
    torch.testing.assert_close(w.grad, we.grad, rtol=0, atol=0)


# --------------------------------------------------------------------------- version counters


def _exp_then_add_in_region(scope: Any, x: torch.Tensor) -> torch.Tensor:
    with scope():
        y = x.exp()  # exp saves its result
        z = y * 2
        y.add_(1)
    return z


def _exp_then_add_after_region(scope: Any, x: torch.Tensor) -> Any:
    with scope():
        y = x.exp()
        z = y * 2
    y.add_(1)
    # y stays referenced until backward: the engine can only check the version of a tensor it can
    # still see (DESIGN.md §3, version checks); when y is gone, recompute gives eager's gradient
    # of the unmodified graph instead of an error (documented limit).
    return z, y


def _inplace_twice_in_region(scope: Any, x: torch.Tensor) -> torch.Tensor:
    with scope():
        a = x.sin()
        a.sin_()
        b = a.sin()  # saves a at version 1
        a.sin_()  # version 2
    return a + b


def _input_modified_after_region(scope: Any, x: torch.Tensor) -> torch.Tensor:
    h = x * 1  # non-leaf region input
    with scope():
        z = (h * x).sin()  # mul saves h
    h.add_(1)
    return z


def _input_modified_in_region(scope: Any, x: torch.Tensor) -> torch.Tensor:
    h = x * 1
    with scope():
        z = (h * x).sin()
        h.mul_(2)
    return z


def _view_modified_in_region(scope: Any, x: torch.Tensor) -> torch.Tensor:
    with scope():
        y = x.sigmoid()  # sigmoid saves its result
        y[1:].zero_()
    return y


def _modified_in_next_region(scope: Any, x: torch.Tensor) -> torch.Tensor:
    with scope():
        y = x.tanh()  # tanh saves its result
    with scope():
        y.mul_(3)
    return y


def _view_modified_after_region(scope: Any, x: torch.Tensor) -> Any:
    with scope():
        y = x.exp()
        z = y.sum(0) * y[0]  # mul saves the view y[0]
    y[0].add_(1)
    return z, y


VERSION_CASES: dict[str, Callable[..., torch.Tensor]] = {
    "in_region": _exp_then_add_in_region,
    "after_region": _exp_then_add_after_region,
    "input_after_region": _input_modified_after_region,
    "input_in_region": _input_modified_in_region,
    "through_view_in_region": _view_modified_in_region,
    "in_next_region": _modified_in_next_region,
    "twice_in_region": _inplace_twice_in_region,
    "view_after_region": _view_modified_after_region,
}


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("case", list(VERSION_CASES))
def test_saved_tensor_modified_in_place_raises(case: str, policy: Any) -> None:
    fn = VERSION_CASES[case]
    out = fn(contextlib.nullcontext, leaf(3, 4))
    with pytest.raises(RuntimeError, match=VERSION_ERROR):
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    out = fn(lambda: cg.save_recompute_policy(policy), leaf(3, 4))
    with pytest.raises(RuntimeError, match=VERSION_ERROR):
        (out[0] if isinstance(out, tuple) else out).sum().backward()


@pytest.mark.parametrize(
    "policy", ["recompute_all", save_matmuls], ids=["recompute_all", "save_matmuls"]
)
def test_version_limit_when_mutated_tensor_is_gone(policy: Any) -> None:
    # Documented limit (DESIGN.md §3, version checks): a recomputed value mutated after the
    # region whose tensor object is gone before backward cannot be checked. Eager raises; the
    # region gives the gradient of the forward as it ran (pre-mutation values).
    def fn(scope: Any, x: torch.Tensor) -> torch.Tensor:
        with scope():
            y = x.exp()
            z = y * y
        y.add_(1)
        return z  # y dies here

    out = fn(contextlib.nullcontext, leaf(3, 4))
    with pytest.raises(RuntimeError, match=VERSION_ERROR):
        out.sum().backward()
    x = leaf(3, 4)
    fn(lambda: cg.save_recompute_policy(policy), x).sum().backward()
    xe = leaf(3, 4)
    (xe.exp() * xe.exp()).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)


# --------------------------------------------------------------------------- failure during recompute


def test_op_failing_during_recompute_names_op_and_position() -> None:
    positions: list[int] = []

    def recompute_and_note(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if "fragile" in str(op):
            positions.append(ctx.op_index)
        return CheckpointPolicy.PREFER_RECOMPUTE

    x = leaf(3)
    with cg.save_recompute_policy(recompute_and_note):
        h = x.sin().cos()
        a = fragile(h)
        y = a.sin()  # sin saves a: backward recomputes the fragile op, which now fails
    del a, h  # a held value is not recomputed (Note [Live forward tensors])
    assert CALLS["fragile"] == 1 and len(positions) == 1
    # The op's own exception, with a note naming it (Note [Errors raised by a recomputed op]).
    with pytest.raises(RuntimeError, match="fragile op called again") as info:
        y.sum().backward()
    assert not isinstance(info.value, cg.CkptGraphError)
    note = "\n".join(info.value.__notes__)
    assert (
        f"ckpt_graph: raised while recomputing op #{positions[0]} ckpt_graph_test.fragile.default "
        f"(position {positions[0]} of the region's forward)" in note
    ), note


def test_op_failing_during_recompute_does_not_break_next_region() -> None:
    x = leaf(3)
    with cg.save_recompute_policy("recompute_all"):
        y = fragile(x.exp()).sin()
    with pytest.raises(RuntimeError, match="fragile op called again"):
        y.sum().backward()
    FRAGILE["max_calls"] = 10
    x2, xe = leaf(3), leaf(3)
    with cg.save_recompute_policy("recompute_all"):
        y2 = fragile(x2.exp()).sin()
    y2.sum().backward()
    FRAGILE["max_calls"] = 100
    fragile(xe.exp()).sin().sum().backward()
    torch.testing.assert_close(x2.grad, xe.grad, rtol=0, atol=0)
