"""Regions under torch.compile: lowered to torch's checkpoint with a selective-checkpoint policy.

# Note [Regions under torch.compile]
# A region records aten ops with a TorchDispatchMode, which dynamo cannot trace: it skips
# every frame while one is active. What the compiler does understand is torch's checkpoint
# higher-order op, with a selective-checkpoint (SAC) context whose ``policy_fn(ctx, op, *args,
# **kwargs)`` AOT autograd asks once per aten op while it traces the region's body on fake
# tensors; the partitioner then keeps (MUST_SAVE / PREFER_SAVE) or recomputes
# (PREFER_RECOMPUTE / MUST_RECOMPUTE) each op's outputs as the answer says. So, while dynamo
# traces (``torch.compiler.is_compiling()``), a wrapped module or ``checkpoint`` call is
# *lowered*: it calls ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False,
# context_fn=partial(lowered_contexts, policy, ...))``, and the region's policy answers through
# ``LoweredPolicy``:
#   1. The policy keeps its meaning: it is asked as ``policy(ctx, out, op, *args, **kwargs)``
#      with ``out`` the op's (fake) result, through the same stack resolution as in eager
#      (``decisions.resolve``; Note [Policy stack resolution]): ``True`` is MUST_SAVE, ``False``
#      PREFER_RECOMPUTE, ``None`` abstains and leaves the starting PREFER_SAVE, which the
#      partitioner honours as a kept value, as eager does. A SAC ``context_fn`` given to
#      ``checkpoint`` is pushed as the inner policy, as in eager.
#   2. ``ctx`` (a ``CompileContext``) is filled at trace time: ``op_index`` (position among the
#      ops torch's SAC asks about: it skips ``detach``), ``op_name``, ``out_bytes`` and
#      ``flops`` from the fake outputs, ``is_random``, ``is_inplace``, ``kept_bytes`` (outputs
#      decided kept so far in this trace), ``module_path`` from the node's ``nn_module_stack``
#      named as eager names it (relative to the outermost module called inside the region).
#      ``ctx.region`` and ``ctx.module`` are ``None``: there is no region object and no module
#      instance at that point. ``ctx.compiling`` is ``True`` (``False`` on the eager context).
#   3. CPU_OFFLOAD answers are lowered to the matching SAVE (the compiler has no offload
#      decision); a warning says so once per policy.
#   4. A policy that cannot be honoured on fake tensors (it reads a value: ``out.max() > 0``
#      raises on a fake tensor) abstains for that op, with one warning per policy naming it.
#   5. Policies that need the region itself, those with ``on_region_enter`` (``memory_budget``
#      records the step at run time, ``save_module_outputs`` tags values from module hooks;
#      combinators that contain them), are not lowered: the caller falls back to running the
#      region eagerly behind a graph break, with a warning (``runs_eagerly``). Except a
#      policy that the compiler's partitioner plans, one with a ``compile_fraction`` (a
#      ``memory_budget`` fraction, as the region's policy, not inside a combinator): its
#      region is traced as a plain call (inside an enclosing lowered region, that region's
#      policies still decide its ops), or, with a torch SAC ``context_fn`` to honour, lowered
#      with an abstaining entry for it (PREFER_SAVE: to the partitioner, untagged), so the
#      partitioner plans the same joint graph as compile's own ``activation_memory_budget``
#      would. When dynamo traces the region
#      (a call dynamo runs at trace time, before AOT autograd and its cache key) it sets the
#      partitioner's budget and knapsack solver (``compile_solver()``, Note [memory_budget under
#      torch.compile] in planner/compile_solver.py) in ``torch._functorch.config``, only
#      until dynamo's compile of that frame ends (a dynamo end-of-compile callback restores
#      the previous values and removes itself), so no other graph is planned with them. The
#      partitioner has one budget per graph: a second fraction in the same graph warns once
#      and the first one plans. A fraction of 1.0 keeps all (compile's default).
#   6. A policy object must exist before the compiled function runs (an attribute, a global, an
#      argument): dynamo passes it to the SAC context as a constant, and one built inside the
#      traced code is not one (dynamo graph-breaks there, and the frame runs eagerly).
#   7. Nesting: a lowered region traced inside another (``checkpoint`` called in a wrapped
#      block) asks the outer regions' policies first, then its own, as one stack resolved as
#      in eager. Both SAC modes tag each op's graph nodes; the inner one runs its ``policy_fn``
#      last, so its answer, the whole stack's, is the one the partitioner reads.
# Known limitations: ``tag_with_policy`` has no lowering (a tag decides for a value after its
# op ran; SAC decides per op as it runs); a ``with save_recompute_policy(...)`` block inside
# compiled code is not a function and cannot become a checkpoint call: dynamo graph-breaks on
# it and the block runs eagerly, as before; ``ctx.op_index`` counts from the innermost lowered
# region's first op (eager counts from the outermost region's).
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.checkpoint import checkpoint as _torch_checkpoint  # before any patch

from ckpt_graph.engine.decisions import (
    PolicyFn,
    normalize_policy,
    policy_name,
    resolve,
    tensor_bytes,
)
from ckpt_graph.engine.flops import estimate_flops
from ckpt_graph.engine.op_info import op_info
from ckpt_graph.engine.torch_sac import policy_from_context_fn

__all__ = [
    "CompileContext",
    "LoweredPolicy",
    "checkpoint_lowered",
    "compile_fraction",
    "needs_region",
    "runs_eagerly",
]

_SAVE_INSTEAD = {
    CheckpointPolicy.PREFER_CPU_OFFLOAD: CheckpointPolicy.PREFER_SAVE,
    CheckpointPolicy.MUST_CPU_OFFLOAD: CheckpointPolicy.MUST_SAVE,
}
_KEPT = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def compile_fraction(policy: Any) -> float | None:
    """The partitioner's budget of a policy it plans under compile, else ``None``.

    See Note [Regions under torch.compile] (5). Pure, so that dynamo can inline it.
    """
    if isinstance(policy, str):
        return None
    fraction = getattr(policy, "compile_fraction", None)
    return fraction if isinstance(fraction, float) else None


def runs_eagerly(policy: Any) -> bool:
    """Whether a region with ``policy`` falls back to running eagerly under compile.

    See Note [Regions under torch.compile] (5).
    """
    return needs_region(policy) and compile_fraction(policy) is None


def needs_region(policy: Any) -> bool:
    """Whether ``policy`` needs a region object at run time, so it cannot be lowered.

    A policy says so with an ``on_region_enter`` method, unless it answers ``needs_region``
    itself (a combinator asks its members). See Note [Regions under torch.compile] (5).
    """
    if isinstance(policy, str):
        return False
    own = getattr(policy, "needs_region", None)
    if isinstance(own, bool):
        return own
    return callable(getattr(policy, "on_region_enter", None))


class CompileContext:
    """What a policy knows about an op while torch.compile traces a lowered region.

    The attributes of the eager context, filled from fake tensors and FX node metadata.
    See Note [Regions under torch.compile] (2).

    Attributes:
        region: ``None`` (no region object exists under compile).
        module: ``None``.
        op_index: position of the op among those asked in this region.
        op_name: e.g. ``"aten.mm.default"``.
        kept_bytes: bytes of the outputs decided kept so far in this region's trace.
        module_path: dotted module path, relative to the outermost module called in the
            region, as in eager.
        compiling: ``True``.
    """

    __slots__ = ("_args", "_kwargs", "_op", "_out", "kept_bytes", "module_path", "op_index")

    region = None
    module = None
    compiling = True

    def __init__(self) -> None:
        self.op_index = 0
        self.kept_bytes = 0
        self.module_path = ""
        self._op: Any = None
        self._out: Any = None
        self._args: Any = ()
        self._kwargs: Any = {}

    def set_op(self, op: Any, out: Any, args: Any, kwargs: Any) -> None:
        """Point the context at the op about to be decided (the lowering calls it)."""
        self._op, self._out, self._args, self._kwargs = op, out, args, kwargs

    def clear_op(self) -> None:
        """Drop the decided op's tensors, so the context holds none between ops."""
        self._out = self._args = self._kwargs = None

    @property
    def op_name(self) -> str:
        return str(self._op)

    @property
    def is_random(self) -> bool:
        return op_info(self._op).is_random

    @property
    def is_inplace(self) -> bool:
        return op_info(self._op).is_inplace

    @property
    def out_bytes(self) -> int:
        return tensor_bytes(self._out)

    @property
    def flops(self) -> int:
        return estimate_flops(self._op, self._out, self._args, self._kwargs)


_INDEX = re.compile(r"\[['\"]?([^\]'\"]*)['\"]?\]")


def _dotted(source: str) -> str:
    """A dynamo source name (``L['self'].blocks[0].attn``) as a dotted path (``blocks.0.attn``)."""
    return _INDEX.sub(r".\1", source).lstrip(".")


def module_path_from_meta(
    stack: dict[str, tuple[str, Any]] | None, root_cls: type | None, root_called: bool
) -> str:
    """The eager ``ctx.module_path`` of an op from its FX ``nn_module_stack``.

    ``root_cls``: the class of the module the region belongs to (``None`` for a function):
    the entries up to its outermost occurrence are outside the region, except that module
    itself when ``root_called`` (``checkpoint(module, ...)`` calls it inside the region;
    ``wrap`` runs only its forward body there). Names are relative to the first entry left,
    as eager names them relative to the outermost module called in the region.
    """
    if not stack:
        return ""
    entries = list(stack.values())
    start = 0
    if root_cls is not None:
        for i, entry in enumerate(entries):
            if len(entry) > 1 and entry[1] is root_cls:
                start = i if root_called else i + 1
                break
    inside = entries[start:]
    if not inside:
        return ""
    root, innermost = _dotted(str(inside[0][0])), _dotted(str(inside[-1][0]))
    if innermost == root:
        return ""
    return innermost[len(root) + 1 :] if innermost.startswith(root + ".") else innermost


_WARNED: set[tuple[str, str]] = set()


def _warn_once(kind: str, name: str, message: str) -> None:
    if (kind, name) not in _WARNED:
        _WARNED.add((kind, name))
        warnings.warn(message, UserWarning, stacklevel=3)


class LoweredPolicy:
    """The SAC ``policy_fn`` that asks a ckpt_graph policy stack at trace time.

    One object per trace of a lowered region (made by ``lowered_contexts``): ``op_index`` and
    ``kept_bytes`` count from the region's first op. See Note [Regions under torch.compile].
    """

    __slots__ = ("ctx", "names", "root_called", "root_cls", "stack")

    def __init__(
        self, stack: list[PolicyFn], root_cls: type | None = None, root_called: bool = False
    ) -> None:
        self.stack = stack
        self.names = [policy_name(p) for p in stack]
        self.root_cls = root_cls
        self.root_called = root_called
        self.ctx = CompileContext()

    def __call__(self, sac_ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        import torch.fx.traceback as fx_traceback

        ctx = self.ctx
        out = sac_ctx.op_output
        ctx.set_op(op, out, args, kwargs)
        meta = fx_traceback.current_meta or {}
        ctx.module_path = module_path_from_meta(
            meta.get("nn_module_stack"), self.root_cls, self.root_called
        )
        try:
            decision, by = resolve(self.stack, ctx, out, op, args, kwargs, self.names)
        except Exception as exc:  # See Note [Regions under torch.compile] (4)
            if not _reads_values(exc):
                raise
            names = ", ".join(self.names)
            _warn_once(
                "values",
                names,
                f"ckpt_graph: policy {names} read a tensor value for op {ctx.op_name} while "
                f"torch.compile traced its region on fake tensors ({type(exc).__name__}); it "
                "abstains for such ops under compile (they are kept, PREFER_SAVE). Decide "
                "from ctx.out_bytes, ctx.flops, shapes and the op instead",
            )
            decision, by = CheckpointPolicy.PREFER_SAVE, ""
        finally:
            ctx.clear_op()
        lowered = _SAVE_INSTEAD.get(decision)
        if lowered is not None:
            _warn_once(
                "offload",
                by,
                f"ckpt_graph: policy {by} answered {decision.name} under torch.compile, which "
                f"has no offload decision; its values are kept ({lowered.name}) instead",
            )
            decision = lowered
        if decision in _KEPT:
            ctx.kept_bytes += tensor_bytes(out)
        ctx.op_index += 1
        return decision


def _reads_values(exc: Exception) -> bool:
    """Whether ``exc`` is what a fake tensor raises when its value is read."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)):
        return True
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(exc, GuardOnDataDependentSymNode)


def _enclosing() -> LoweredPolicy | None:
    """The policy of the lowered region this one is traced inside, if any."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        policy_fn = getattr(mode, "policy_fn", None)
        if isinstance(policy_fn, LoweredPolicy):
            return policy_fn
    return None


class _PlannedByPartitioner:
    """The lowered entry of a policy the partitioner plans: it abstains for every op (the
    partitioner decides, with the budget and solver ``_plan_in_this_compile`` set).
    See Note [Regions under torch.compile] (5)."""

    __slots__ = ("__qualname__", "policy")

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.__qualname__ = repr(policy)

    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        return None


def _plan_in_this_compile(policy: Any) -> None:
    """Let the partitioner plan ``policy``'s budget in the compile of the frame being traced."""
    fraction = compile_fraction(policy)
    if fraction is not None and fraction < 1.0:
        _plan_with(policy, fraction)


# Dynamo runs a function so marked while it traces (``torch._dynamo.assume_constant_result``
# sets this attribute), before AOT autograd starts: its cache key then sees the solver (which
# asks not to be cached), and a partition planned for one budget is never reused for another.
_plan_in_this_compile._dynamo_marked_constant = True  # type: ignore[attr-defined]


class _Planning:
    """The partitioner's config while a frame whose graph holds a planned region compiles."""

    __slots__ = ("fraction", "policy", "previous")

    def __init__(self, policy: Any, fraction: float, previous: tuple[Any, Any]) -> None:
        self.policy = policy
        self.fraction = fraction
        self.previous = previous


_PLANNING: list[_Planning] = []  # at most one: the frame being compiled


def _plan_with(policy: Any, fraction: float) -> None:
    """Set the partitioner's budget and solver until dynamo's compile of this frame ends."""
    from torch._functorch import config

    if _PLANNING:
        current = _PLANNING[0]
        if current.policy is not policy and current.fraction != fraction:
            _warn_once(
                "budgets",
                repr(policy),
                f"ckpt_graph: {policy!r} and {current.policy!r} plan regions of one compiled "
                f"graph; torch.compile's partitioner has one budget per graph, so "
                f"{current.policy!r} plans it (separate them with a graph break to give "
                "each its own)",
            )
        return
    from torch._dynamo.callback import callback_handler as handler

    solver = policy.compile_solver()
    planning = _Planning(
        policy,
        fraction,
        (config.activation_memory_budget, config.activation_memory_budget_solver),
    )
    config.activation_memory_budget = fraction
    config.activation_memory_budget_solver = solver

    def restore(_args: Any) -> None:
        config.activation_memory_budget, config.activation_memory_budget_solver = planning.previous
        _PLANNING.clear()
        # a new list: the handler may be iterating over the current one
        handler.end_callbacks = [c for c in handler.end_callbacks if c is not restore]

    handler.register_end_callback(restore)
    _PLANNING.append(planning)


def lowered_contexts(
    policy: Any,
    inner: Callable[[], Any] | None = None,
    root_cls: type | None = None,
    root_called: bool = False,
) -> tuple[Any, Any]:
    """The ``context_fn`` target of a lowered region: torch's SAC pair asking ``policy``.

    ``inner``: a torch SAC ``context_fn`` given to ``checkpoint``, whose ``policy_fn`` is
    pushed as the inner policy (as ``checkpoint`` does in eager).
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    stack = [normalize_policy(policy)]
    if compile_fraction(policy) is not None:
        stack = [_PlannedByPartitioner(policy)]
    outer = _enclosing()
    if outer is not None:  # See Note [Regions under torch.compile] (7)
        stack = [*outer.stack, *stack]
    if inner is not None:
        torch_policy = policy_from_context_fn(inner)
        if torch_policy is not None:
            stack.append(torch_policy)
    return create_selective_checkpoint_contexts(  # type: ignore[no-any-return]
        LoweredPolicy(stack, root_cls, root_called)
    )


def checkpoint_lowered(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policy: Any,
    *,
    inner: Callable[[], Any] | None = None,
    root_cls: type | None = None,
    root_called: bool = False,
) -> Any:
    """``fn(*args, **kwargs)`` as torch's checkpoint with ``policy`` lowered to SAC.

    Called while dynamo traces; see Note [Regions under torch.compile].
    """
    if compile_fraction(policy) is not None:  # See Note [Regions under torch.compile] (5)
        _plan_in_this_compile(policy)
        if inner is None:  # nothing to tag: the partitioner sees the ops as compile's own
            return fn(*args, **kwargs)
    # torch's own function, also inside ``patch_torch_checkpoint`` (whose patched name would
    # lead back here); dynamo recognises it by identity.
    context_fn = functools.partial(lowered_contexts, policy, inner, root_cls, root_called)
    return _torch_checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
