"""Errors on user mistakes: one catchable type, clear messages, no state left behind.

Covers issue 14 items 2 (``.data`` writes under ``debug=True``), 15 (a policy whose
``on_region_enter`` fails leaves nothing on the stack), 16 (``tag_with_policy`` argument
types) and 17 (every raise of the package is a ``CkptGraphError``; see Note [Error types]).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_graph as cg
from ckpt_graph import (
    CheckpointPolicy,
    CkptGraphError,
    CkptGraphImportError,
    CkptGraphTypeError,
    CkptGraphValueError,
    policies,
)
from ckpt_graph.engine.region import current_region

PACKAGE = pathlib.Path(cg.__file__).parent


# --------------------------------------------------------------------------- item 2: .data
def _grads(fn: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    loss = fn()
    return list(torch.autograd.grad(loss, params))


def test_data_write_on_parameter_between_forward_and_backward_raises_under_debug() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all", debug=True):
        loss = torch.tanh(x @ w).sin().sum()
    w.data.mul_(2)  # no version bump: the engine's version check cannot see it
    with pytest.raises(
        CkptGraphError, match=r"a parameter .*\[torch\.float32 \[4, 4\]\].*`\.data`"
    ):
        loss.backward()


def test_data_write_that_only_moves_values_raises_under_debug() -> None:
    # A permutation keeps the sum and the sum of squares, and elementwise ops keep it
    # through the recomputed values: the checksums compared only those (issue 14 re-check).
    w = torch.randn(8, requires_grad=True)
    with cg.save_recompute_policy("recompute_all", debug=True):
        loss = (w * 2).exp().sum()  # exp saves its result, recomputed from w
    w.data.copy_(w.data.flip(0))
    with pytest.raises(CkptGraphError, match=r"region input #0.*`\.data`"):
        loss.backward()


def test_data_write_on_kept_value_raises_under_debug() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all", debug=True):
        h = x.exp()
        cg.tag_with_policy(h, True)
        loss = h.sin().cos().sum()
    h.data.add_(1)
    with pytest.raises(CkptGraphError, match=r"output 0 of op #0 aten\.exp\.default.*`\.data`"):
        loss.backward()


def test_debug_kept_checks_allow_unchanged_values_and_give_exact_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Tanh())
    x = torch.randn(5, 8, requires_grad=True)
    params = [x, *model.parameters()]
    expected = _grads(lambda: model(x).pow(2).sum(), params)

    def run() -> torch.Tensor:
        with cg.save_recompute_policy(policies.save_matmuls(), debug=True):
            return model(x).pow(2).sum()

    for got, want in zip(_grads(run, params), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_data_write_after_backward_is_fine_under_debug() -> None:
    # The optimizer's `p.data.add_(...)` runs after backward: nothing is checked then.
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4)
    for _ in range(2):
        with cg.save_recompute_policy("recompute_all", debug=True):
            loss = torch.tanh(x @ w).sum()
        loss.backward()
        w.data.add_(w.grad, alpha=-0.1)  # type: ignore[arg-type]
        w.grad = None


# --------------------------------------------------------------------------- item 15
class _FailsOnEnter:
    """A policy that keeps everything, but whose ``on_region_enter`` raises."""

    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        return True

    def on_region_enter(self, region: cg.Region) -> None:
        raise ValueError("cannot start here")

    def on_region_exit(self, region: cg.Region) -> None:
        raise AssertionError("never entered, never exited")


def _kept_ops(region: cg.Region) -> list[int]:
    return [n.index for n in region.nodes if any(o is not None and o.kept for o in n.outputs)]


@pytest.mark.parametrize("outer", ["recompute_all", policies.save_matmuls()])
def test_failed_on_region_enter_in_nested_block_leaves_nothing_behind(outer: Any) -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def body(fail: bool) -> tuple[cg.Region, torch.Tensor]:
        with cg.save_recompute_policy(outer) as region:
            h = torch.tanh(x @ w)
            if fail:
                with (
                    pytest.raises(ValueError, match="cannot start here"),
                    cg.save_recompute_policy(_FailsOnEnter()),
                ):
                    raise AssertionError("the block must not run")
            assert len(region.policies) == 1
            loss = (torch.sin(h @ w) * h).sum()
        return region, loss

    ref_region, ref_loss = body(fail=False)
    region, loss = body(fail=True)
    assert _kept_ops(region) == _kept_ops(ref_region)
    assert [n.decided_by for n in region.nodes] == [n.decided_by for n in ref_region.nodes]
    (got,) = torch.autograd.grad(loss, [w])
    (want,) = torch.autograd.grad(ref_loss, [w])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _CountsEvents:
    """A policy that abstains and counts its region events."""

    def __init__(self) -> None:
        self.entered = 0
        self.exited = 0

    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def on_region_enter(self, region: cg.Region) -> None:
        self.entered += 1

    def on_region_exit(self, region: cg.Region) -> None:
        self.exited += 1


@pytest.mark.parametrize("combinator", [policies.any_save, policies.first_answer])
@pytest.mark.parametrize("nested", [True, False])
def test_combinator_member_failing_on_region_enter_exits_the_members_that_entered(
    combinator: Any, nested: bool
) -> None:
    # The members before the failing one had entered (save_module_outputs installs global
    # module hooks there): they stayed installed and tagged tensors outside any region.
    counts = _CountsEvents()
    policy = combinator(counts, policies.save_module_outputs(nn.Linear), _FailsOnEnter())
    block = cg.save_recompute_policy(policy)
    if nested:
        with cg.save_recompute_policy("recompute_all") as region:
            with pytest.raises(ValueError, match="cannot start here"), block:
                raise AssertionError("the block must not run")
            assert len(region.policies) == 1
    else:
        with pytest.raises(ValueError, match="cannot start here"), block:
            raise AssertionError("the block must not run")
    assert (counts.entered, counts.exited) == (1, 1)
    nn.Linear(2, 2)(torch.randn(3, 2))  # no hook of the policy left: runs outside a region


def test_failed_on_region_enter_at_top_level_closes_the_region() -> None:
    with (
        pytest.raises(ValueError, match="cannot start here"),
        cg.save_recompute_policy(_FailsOnEnter()),
    ):
        raise AssertionError("the block must not run")
    assert current_region() is None


# --------------------------------------------------------------------------- item 16
@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((3.0, True), r"needs a torch\.Tensor as `tensor`, got float"),
        (("h", CheckpointPolicy.MUST_SAVE), r"needs a torch\.Tensor as `tensor`, got str"),
        ((None, 1.0), r"as `policy`, got float"),
    ],
)
@pytest.mark.parametrize("inside", [True, False])
def test_tag_with_policy_argument_types(args: tuple[Any, Any], match: str, inside: bool) -> None:
    h = torch.randn(3, requires_grad=True)
    tensor = h if args[0] is None else args[0]
    if inside:
        with cg.save_recompute_policy("recompute_all"):
            y = h.exp()
            with pytest.raises(CkptGraphTypeError, match=match):
                cg.tag_with_policy(y if args[0] is None else tensor, args[1])
    else:
        with pytest.raises(CkptGraphTypeError, match=match):
            cg.tag_with_policy(tensor, args[1])


# --------------------------------------------------------------------------- item 17
class _NoModuleList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


def _enter_twice() -> None:
    block = cg.save_recompute_policy()
    with block, block:
        pass


def _policy_answers(answer: Any) -> None:
    def bad(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return answer

    with cg.save_recompute_policy(bad):
        torch.randn(2, requires_grad=True).exp()


def _policy_answers_in_operator(answer: Any) -> None:
    def bad(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return answer

    x = torch.randn(2, requires_grad=True)
    with cg.save_recompute_policy(bad):
        x * 2  # torch turns a TypeError raised under an operator into NotImplemented


def _explain(arg: Any) -> None:
    with cg.save_recompute_policy() as region:
        torch.randn(2, requires_grad=True).exp()
    region.explain(arg)


def _flat_grads(arg: Any) -> None:
    from ckpt_graph.grads import FlatGrads

    FlatGrads(arg)


def _abn() -> None:
    from ckpt_graph.nn import InPlaceABN

    InPlaceABN(4, activation="swish")


def _hf_enable() -> None:
    from ckpt_graph.integrations import transformers as cg_hf

    cg_hf.enable(nn.Linear(2, 2))


def _workload() -> None:
    from ckpt_graph.compare.zoo import build_workload

    build_workload("resnet")


def _comparison() -> None:
    from ckpt_graph.compare.runner import run_comparison

    run_comparison(model="mlp", strategies=["nope"])


# (call, builtin type older code catches, message pattern)
BAD_CALLS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("policy name", lambda: cg.save_recompute_policy("save_all"), ValueError, "unknown policy"),
    ("policy type", lambda: cg.save_recompute_policy(3), TypeError, "a policy must be a name"),
    ("enter twice", _enter_twice, RuntimeError, "cannot be entered twice"),
    ("policy answer", lambda: _policy_answers(3), RuntimeError, r"returned 3 for op aten\.randn"),
    (
        "policy answer, operator",
        lambda: _policy_answers_in_operator("save"),
        RuntimeError,
        r"returned 'save' for op aten\.mul\.Tensor",
    ),
    ("tag tensor", lambda: cg.tag_with_policy(3.0, True), TypeError, "`tensor`"),
    ("budget type", lambda: policies.memory_budget([1]), TypeError, "memory_budget got list"),
    ("budget fraction", lambda: policies.memory_budget(1.5), ValueError, r"in \(0, 1\]"),
    ("budget bytes", lambda: policies.memory_budget(-1), ValueError, "must be at least 1 KiB"),
    ("save_ops op", lambda: policies.save_ops("mm"), TypeError, "expected aten ops"),
    ("save_ops rest", lambda: policies.save_ops(rest=3), TypeError, "rest must be"),
    ("offload", lambda: policies.offload(3), TypeError, "select must be a callable"),
    ("first_answer", lambda: policies.first_answer(), ValueError, "needs at least one"),
    ("first_answer member", lambda: policies.first_answer(3), TypeError, "expected a policy"),
    ("from_torch_sac", lambda: policies.from_torch_sac(3), TypeError, "from_torch_sac"),
    ("save_module_outputs", lambda: policies.save_module_outputs(3), TypeError, "match must"),
    ("wrap type", lambda: cg.wrap(3), TypeError, "takes an nn.Module"),  # type: ignore[arg-type]
    ("wrap nothing", lambda: cg.wrap(_NoModuleList()), ValueError, "no nn.ModuleList"),
    ("wrap match", lambda: cg.wrap(_NoModuleList(), match=3), TypeError, "match=..."),  # type: ignore[arg-type]
    ("measure device", lambda: cg.measure(lambda: None, device="tpu"), ValueError, "device"),
    ("explain type", lambda: _explain(3), TypeError, r"needs a torch\.Tensor"),
    ("explain unseen", lambda: _explain(torch.ones(2)), ValueError, "never seen"),
    ("FlatGrads tensor", lambda: _flat_grads(torch.ones(2)), TypeError, "single tensor"),
    ("FlatGrads element", lambda: _flat_grads([3]), TypeError, "not a tensor"),
    ("InPlaceABN", _abn, ValueError, "activation must be one of"),
    ("hf enable", _hf_enable, TypeError, "PreTrainedModel"),
    ("workload", _workload, ValueError, "unknown model"),
    ("compare", _comparison, ValueError, "unknown strategy 'nope'"),
]


@pytest.mark.parametrize(
    ("call", "builtin", "match"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_public_argument_checks_raise_ckpt_graph_errors(
    call: Callable[[], Any], builtin: type[Exception], match: str
) -> None:
    with pytest.raises(CkptGraphError, match=match) as info:
        call()
    assert isinstance(info.value, builtin), "older `except ValueError/TypeError` code must work"


def test_error_subclasses_are_both_types() -> None:
    assert issubclass(CkptGraphValueError, ValueError) and issubclass(
        CkptGraphValueError, CkptGraphError
    )
    assert issubclass(CkptGraphTypeError, TypeError) and issubclass(
        CkptGraphTypeError, CkptGraphError
    )
    assert issubclass(CkptGraphImportError, ImportError)
    assert issubclass(CkptGraphError, RuntimeError)


# Classes raised inside the package and always caught there: not seen by users.
_INTERNAL = {
    ("strategies.py", "StrategySkipped"),  # control flow of the compare runner
    # a module __getattr__ must raise AttributeError (Python's protocol)
    ("__init__.py", "AttributeError"),
    ("lightning.py", "AttributeError"),
    ("transformers.py", "AttributeError"),
}
# Messages printed by the command line after its own prefix (see Note [Error types]).
_CLI_FILES = {"cli.py", "zoo.py", "runner.py", "strategies.py"}


def _raise_sites() -> list[tuple[str, int, ast.Raise]]:
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(PACKAGE).as_posix()
        sites += [(rel, n.lineno, n) for n in ast.walk(tree) if isinstance(n, ast.Raise)]
    return sites


def _first_text(call: ast.Call) -> str | None:
    """The literal start of the message argument, or ``None`` if it is not a literal."""
    if not call.args:
        return None
    a = call.args[0]
    while isinstance(a, ast.BinOp):  # "..." + where
        a = a.left
    if isinstance(a, ast.Constant) and isinstance(a.value, str):
        return a.value
    if isinstance(a, ast.JoinedStr) and a.values and isinstance(a.values[0], ast.Constant):
        return str(a.values[0].value)
    return None


def test_every_raise_in_the_package_is_a_ckpt_graph_error() -> None:
    """Reads every ``raise`` of ckpt_graph/: a new plain ``raise ValueError(...)`` fails here."""
    sites = _raise_sites()
    assert len(sites) > 80  # the walk found the package's raises
    problems = []
    for rel, line, node in sites:
        exc = node.exc
        if exc is None or (isinstance(exc, ast.Name) and exc.id.islower()):
            continue  # bare re-raise, or re-raising a caught exception object
        if not isinstance(exc, ast.Call):
            problems.append(f"{rel}:{line}: raises {ast.unparse(exc)} (not a constructor call)")
            continue
        modname = "ckpt_graph." + rel.removesuffix(".py").replace("/", ".")
        modname = (
            modname.removesuffix(".__init__").removesuffix("ckpt_graph.__init__") or "ckpt_graph"
        )
        module = importlib.import_module(modname)
        target: Any = module
        for i, part in enumerate(ast.unparse(exc.func).split(".")):
            target = getattr(builtins if i == 0 and not hasattr(target, part) else target, part)
        if inspect.isclass(target):
            if (rel.rsplit("/", 1)[-1], target.__name__) in _INTERNAL:
                continue
            if not issubclass(target, CkptGraphError):
                problems.append(f"{rel}:{line}: raises {target.__name__}, not a CkptGraphError")
                continue
            text = _first_text(exc)
            if text is None and exc.args and isinstance(exc.args[0], ast.Name):
                text = getattr(module, exc.args[0].id, None)
            if rel.rsplit("/", 1)[-1] not in _CLI_FILES and not (
                isinstance(text, str) and text.startswith("ckpt_graph: ")
            ):
                problems.append(f"{rel}:{line}: message does not start with 'ckpt_graph: '")
        else:  # a helper building the error: its return annotation must say so
            ret = inspect.signature(target).return_annotation
            if "CkptGraphError" not in str(ret):
                problems.append(f"{rel}:{line}: {target.__name__}() is not annotated as an error")
    assert not problems, "\n".join(problems)
