"""The recorder's one path (see Note [One recording path] in ckpt_graph/engine/record.py).

Every op goes through the same steps whatever the policy stack, so the graph recorded for a
program is the same under a constant stack, a callable policy and a debug region, and the
object sharing the path does (tuples, shapes) holds for all of them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg
from ckpt_graph.engine import graph


def _recompute(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


# (policy, debug): every kind of stack the recorder used to treat differently.
STACKS = [
    ("recompute_all", False),
    ("must_save_all", False),
    (_recompute, False),
    (_keep, False),
    ("recompute_all", True),
]
IDS = ["recompute_all", "must_save_all", "callable-recompute", "callable-keep", "debug"]


def _record(fn: Any, policy: Any, debug: bool, *inputs: Any) -> tuple[Any, Any]:
    with cg.save_recompute_policy(policy, debug=debug) as region:
        out = fn(*inputs)
    return region, out


def _shape(region: Any) -> list[tuple[Any, ...]]:
    """The recorded graph as plain data: op, argument structure, input and output positions."""

    def arg(a: Any) -> Any:
        if isinstance(a, graph.Handle):
            return ("h", a.node_index, a.output_index, a.input_index)
        if isinstance(a, (list, tuple)):
            return [arg(e) for e in a]
        return a

    return [
        (
            n.info.name,
            arg(list(n.args)),
            {k: arg(v) for k, v in n.kwargs.items()},
            [arg(i) for i in n.inputs],
            [arg(o) if o is not None else None for o in n.outputs],
        )
        for n in region.nodes
    ]


def _program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x.sin()  # one tensor argument
    b = a * a  # the same tensor twice
    c = torch.mm(b, w)  # two distinct tensors
    d, e = c.split(2, dim=1)  # a list return
    f = torch.cat([d, e.cos()], dim=1)  # a list argument
    g = f.sum(dim=0, keepdim=True)  # non-tensor arguments
    h = g.to(torch.float64)  # keyword arguments
    h.mul_(2)  # in place
    c2 = torch.mm(b, w)
    v = c2[0]  # a view
    v.add_(1)  # a write through the view: c2 changed through another alias
    return (h.sum() + c2.exp().sum()).float()


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_same_graph_and_gradients_under_every_stack(policy: Any, debug: bool) -> None:
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    ref_region, _ = _record(_program, "recompute_all", False, x, w)
    region, out = _record(_program, policy, debug, x, w)
    assert _shape(region) == _shape(ref_region)
    out.backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    _program(x, w).backward()
    torch.testing.assert_close((gx, gw), (x.grad, w.grad), rtol=0, atol=0)


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_single_input_shares_the_producers_outputs_tuple(policy: Any, debug: bool) -> None:
    x = torch.randn(8, requires_grad=True)
    region, _ = _record(lambda t: t.sin().cos(), policy, debug, x)
    sin, cos = region.nodes
    assert cos.inputs is sin.outputs
    assert cos.args is sin.outputs  # the only argument: the args tuple is shared too


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_distinct_tensor_arguments_share_one_tuple(policy: Any, debug: bool) -> None:
    x = torch.randn(3, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    region, _ = _record(lambda a, b: torch.mm(a.sin(), b), policy, debug, x, w)
    mm = region.nodes[-1]
    assert mm.inputs is mm.args
    assert [h.node_index for h in mm.inputs] == [0, -1]


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_repeated_and_mixed_arguments_keep_distinct_inputs(policy: Any, debug: bool) -> None:
    x = torch.randn(4, requires_grad=True)
    region, _ = _record(lambda t: (t.sin() * t.sin()).pow(2), policy, debug, x)
    mul = region.nodes[2]
    assert len(mul.args) == 2 and len(mul.inputs) == 2  # two sin() results: distinct values
    region, _ = _record(lambda t: (lambda s: s * s)(t.sin()).pow(2), policy, debug, x)
    square, power = region.nodes[1], region.nodes[2]
    assert square.args[0] is square.args[1] and square.inputs == (square.args[0],)
    assert power.args[1] == 2 and power.inputs == (power.args[0],)
    assert power.inputs is square.outputs


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_equal_output_shapes_are_one_object(policy: Any, debug: bool) -> None:
    x = torch.randn(6, 4, requires_grad=True)
    region, _ = _record(lambda t: t.sin().cos().split(2), policy, debug, x)
    sin, cos, split = region.nodes
    assert sin.outputs[0].shape is cos.outputs[0].shape
    shapes = [o.shape for o in split.outputs]
    assert all(s is shapes[0] for s in shapes)  # a list return is interned too
    assert shapes[0] == torch.Size([2, 4])


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_ops_without_keywords_share_one_empty_dict(policy: Any, debug: bool) -> None:
    x = torch.randn(4, requires_grad=True)
    region, _ = _record(lambda t: t.sin().cos().to(torch.float64), policy, debug, x)
    sin, cos, to = region.nodes
    assert sin.kwargs == {} and sin.kwargs is cos.kwargs
    assert to.kwargs == {"dtype": torch.float64}


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_a_tensor_written_in_place_maps_to_its_new_value(policy: Any, debug: bool) -> None:
    x = torch.randn(4, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = t.sin()
        y.mul_(2)
        return y.cos()

    region, out = _record(fn, policy, debug, x)
    sin, mul_, cos = region.nodes
    assert mul_.inputs[0] is sin.outputs[0] and sin.outputs[0].superseded
    assert cos.inputs == mul_.outputs  # the version check found the new value
    out.sum().backward()
    g = x.grad
    x.grad = None
    fn(x).sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=0, atol=0)


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_a_tensor_written_through_another_alias_is_rebased(policy: Any, debug: bool) -> None:
    x = torch.randn(3, 4, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = t.sin()
        y[0].mul_(3)  # y's version changes through a view
        return y.cos()

    region, out = _record(fn, policy, debug, x)
    cos = region.nodes[-1]
    (h,) = cos.inputs
    assert region.nodes[h.node_index].info.name == "aten.as_strided.default"
    assert region.nodes[h.node_index].decided_by == "engine"
    out.sum().backward()
    g = x.grad
    x.grad = None
    fn(x).sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=0, atol=0)


@pytest.mark.parametrize(("policy", "debug"), STACKS, ids=IDS)
def test_a_freed_tensor_whose_id_is_reused_gets_a_new_handle(policy: Any, debug: bool) -> None:
    # Python reuses the id of a freed tensor object: the weak reference tells them apart.
    x = torch.randn(64, requires_grad=True)

    def fn(t: torch.Tensor, cs: list[torch.Tensor]) -> torch.Tensor:
        total = t.sum()
        while cs:
            c = cs.pop()
            total = total + (c * t).sum()
            del c  # the region keeps an alias; the object itself is freed
        return total

    def constants() -> list[torch.Tensor]:
        return [torch.full((64,), float(i + 1)) for i in range(5)]

    region, out = _record(fn, policy, debug, x, constants())
    assert len([h for h in region.inputs if h.shape == torch.Size([64])]) == 6
    out.backward()
    g = x.grad
    x.grad = None
    fn(x, constants()).backward()
    torch.testing.assert_close(g, x.grad, rtol=0, atol=0)


def test_seed_gradient_of_a_backward_inside_the_region_is_not_recorded() -> None:
    x = torch.randn(4, requires_grad=True)
    with cg.save_recompute_policy() as region:
        y = x.sin().sum()
        n = len(region.nodes)
        (g,) = torch.autograd.grad(y, x)
    assert len(region.nodes) == n
    torch.testing.assert_close(g, x.detach().cos(), rtol=0, atol=0)
    with cg.save_recompute_policy() as region:
        z = torch.ones_like(x)  # a user's own ones_like is recorded
    assert region.nodes[-1].info.name == "aten.ones_like.default" and z.sum() == 4


def test_inference_tensors_have_version_zero() -> None:
    with torch.inference_mode():
        c = torch.randn(4)
    x = torch.randn(4, requires_grad=True)
    with cg.save_recompute_policy() as region:
        y = (x + c).sin() + c  # neither add saves c: autograd cannot save inference tensors
    handles = [h for h in region.inputs if h.ref is not None and h.ref() is c]
    assert len(handles) == 1 and handles[0].version == 0
    y.sum().backward()
    torch.testing.assert_close(x.grad, (x + c).cos().detach(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("outer", "inner", "by"),
    [
        ("recompute_all", None, "recompute_all"),
        ("must_save_all", None, "must_save_all"),
        ("recompute_all", "must_save_all", "must_save_all"),
        ("must_save_all", "recompute_all", "must_save_all"),  # a MUST_* is not replaced
    ],
)
def test_constant_stacks_name_the_policy_that_decided(outer: str, inner: Any, by: str) -> None:
    x = torch.randn(4, requires_grad=True)
    with cg.save_recompute_policy(outer) as region:
        if inner is None:
            y = x.sin()
        else:
            with cg.save_recompute_policy(inner):
                y = x.sin()
    (node,) = region.nodes
    assert node.decided_by == by
    assert f"policy {by} answered" in cg.analysis.explain(region, y).why


def test_kept_reasons_are_typed_and_readable() -> None:
    assert {r for r in graph.KeptReason if not r.by_engine} == {
        graph.KeptReason.INPUT,
        graph.KeptReason.POLICY,
        graph.KeptReason.TAG,
    }
    for r in graph.KeptReason:
        assert isinstance(r, str) and str(r) == r.value  # summaries print the text
        assert r.by_engine == r.value.startswith("engine: ")
    x = torch.randn(4, requires_grad=True)
    with cg.save_recompute_policy("must_save_all") as region:
        a = x.sin()
        a.mul_(2)  # the kept sin() output is overwritten: the engine keeps the new version
        cg.tag_with_policy(a, False)  # a tag cannot drop an engine-kept value
        y = a.sum()
    h = region.lookup(a)
    assert h is not None and h.reason is graph.KeptReason.INPLACE_ON_KEPT and h.reason.by_engine
    assert h not in region.tagged
    y.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos(), rtol=0, atol=0)


class _FailsOnEnter:
    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def on_region_enter(self, region: Any) -> None:
        raise ValueError("cannot plan")


@pytest.mark.parametrize("nested", [False, True])
def test_a_block_whose_push_fails_leaves_nothing_entered(nested: bool) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from ckpt_graph.engine.region import current_region

    top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    x = torch.randn(4, requires_grad=True)
    if nested:
        with cg.save_recompute_policy("must_save_all") as region:
            hooks = top_hooks(False)
            with (
                pytest.raises(ValueError, match="cannot plan"),
                cg.save_recompute_policy(_FailsOnEnter()),
            ):
                pass
            assert top_hooks(False) == hooks and current_region() is region
            assert region.policies == (cg.engine.decisions.POLICY_NAMES["must_save_all"],)
            y = x.sin().sum()
        assert region.nodes[0].decided_by == "must_save_all"
        y.backward()
        torch.testing.assert_close(x.grad, x.detach().cos(), rtol=0, atol=0)
    else:
        with (
            pytest.raises(ValueError, match="cannot plan"),
            cg.save_recompute_policy(_FailsOnEnter()),
        ):
            pass
    assert current_region() is None
    assert top_hooks(False) is None and _get_current_dispatch_mode() is None
