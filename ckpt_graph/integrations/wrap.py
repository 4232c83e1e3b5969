"""``wrap`` / ``unwrap``: run the forward of selected submodules in their own regions.

# Note [Wrapping by instance forward]
# 1. ``wrap`` inserts no wrapper modules: it sets an instance attribute ``forward`` (a
#    ``RegionForward``) on each selected module. ``nn.Module.__call__`` looks ``self.forward``
#    up on the instance first, so the module's hooks still run once, *outside* the region
#    (forward pre-hooks, forward hooks, FSDP2's unshard/reshard hooks), while the forward body
#    runs inside ``save_recompute_policy``. ``state_dict()`` keys, ``named_parameters()`` and
#    ``named_modules()`` are unchanged because the module tree is unchanged.
# 2. The ``RegionForward`` calls the forward the module had when it was wrapped: a previous
#    instance attribute if there was one (remembered, and restored by ``unwrap``), otherwise
#    ``type(module).forward`` looked up at call time, so a class swapped later (FSDP2's
#    ``fully_shard`` makes the module an instance of an ``FSDP<Class>`` subclass) still works.
# 3. The ``RegionForward`` holds the module strongly. That is a reference cycle
#    (module -> __dict__ -> RegionForward -> module) collected by the garbage collector, the
#    price of ``copy.deepcopy`` and pickling giving a copy whose forward runs on the copy.
# 4. A selected module inside another selected module is not wrapped: its forward already
#    runs in the outer region (an inner block would only push the same policy again).

# Note [Wrapped modules under torch.compile]
# A region records aten ops with a TorchDispatchMode, which dynamo cannot trace. So:
# 1. ``torch.compile(wrap(model))``: while dynamo traces, ``RegionForward.__call__`` lowers the
#    region to torch's checkpoint with a selective-checkpoint policy that asks the region's
#    policy per op (See Note [Regions under torch.compile] in engine/lowering.py): the wrapped
#    block compiles with the rest of the model, without a graph break.
# 2. A policy that needs the region at run time (``memory_budget`` in bytes,
#    ``save_module_outputs``; a ``memory_budget`` fraction is planned by the partitioner,
#    Note [Regions under torch.compile] rule 5) cannot be lowered: ``RegionForward.__call__`` hands the region to a
#    ``torch._dynamo.disable``-d function instead: one graph break per wrapped module, whose
#    forward runs eagerly in its region, while the code around it is compiled (unless the
#    blocks are called in a loop: dynamo then runs the whole frame eagerly). It warns once
#    per module class, naming the policy.
# 3. ``wrap`` of a model with compiled submodules (``torch.compile(block)`` or
#    ``block.compile()``) inside a selected module, then running it uncompiled: they run
#    eagerly inside the region (dynamo skips frames while the region's dispatch mode
#    records); wrap warns.
# Gradients are exact in cases 2 and 3, and within the compiler's tolerance in case 1;
# ``tests/integration/test_compile.py`` pins each.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ckpt_graph._errors import CkptGraphTypeError, CkptGraphValueError
from ckpt_graph.engine.lowering import checkpoint_lowered, runs_eagerly
from ckpt_graph.integrations.activity import (
    announce,
    describe_modules,
    describe_policy,
    labelled_region,
)

__all__ = ["RegionForward", "describe_wrapped", "is_wrapped", "unwrap", "wrap"]

Match = str | type[torch.nn.Module] | tuple[type[torch.nn.Module], ...]
MatchFn = Callable[[str, torch.nn.Module], bool]


class RegionForward:
    """The instance ``forward`` that ``wrap`` sets: the module's forward inside a region.

    Attributes:
        module: the wrapped module.
        policy: the policy of the region (as given to ``wrap``).
        previous: the instance ``forward`` attribute the module had before, or ``None``
            (then ``type(module).forward`` is called).
        label: ``Region.opened_by`` of the regions it opens (Note [Integrations say when they
            are active]).

    Example:
        >>> block = torch.nn.Linear(4, 4)
        >>> _ = ckpt_graph.wrap(block, match=torch.nn.Linear)
        >>> type(block.forward).__name__
        'RegionForward'
    """

    __slots__ = ("label", "module", "policy", "previous")

    def __init__(
        self, module: torch.nn.Module, policy: Any, previous: Any, label: str = ""
    ) -> None:
        self.module = module
        self.policy = policy
        self.previous = previous
        self.label = label or f"ckpt_graph.wrap: {type(module).__name__}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # constant under dynamo; False when eager
            # See Note [Wrapped modules under torch.compile]
            if runs_eagerly(self.policy):
                return _RUN_EAGERLY[0](self, args, kwargs)
            module = self.module
            if self.previous is None:
                forward = type(module).forward
                return checkpoint_lowered(
                    forward, (module, *args), kwargs, self.policy, root_cls=type(module)
                )
            return checkpoint_lowered(
                self.previous, args, kwargs, self.policy, root_cls=type(module)
            )
        return self.run(args, kwargs)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the module's forward inside a region."""
        forward = self.previous
        with labelled_region(self.policy, self.label):
            if forward is None:
                return type(self.module).forward(self.module, *args, **kwargs)
            return forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"RegionForward({type(self.module).__name__}, policy={self.policy!r})"


def _run_eagerly(rf: RegionForward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The graph break of a wrapped module whose policy cannot be lowered (dynamo-disabled).

    See Note [Wrapped modules under torch.compile] (2).
    """
    warnings.warn(
        f"ckpt_graph: {type(rf.module).__name__}.forward (wrapped by ckpt_graph.wrap) runs "
        f"eagerly under torch.compile: its policy {rf.policy!r} needs the region at run time "
        "(on_region_enter), so it cannot be lowered to torch's selective checkpointing; the "
        "code around it stays compiled (one graph break per wrapped module, unless the blocks "
        "run in a loop) and gradients are exact",
        UserWarning,
        stacklevel=2,
    )
    return rf.run(args, kwargs)


# ``_run_eagerly`` excluded from dynamo, made by the first ``wrap()`` call: importing dynamo
# costs seconds, too much for ``import ckpt_graph``, and RegionForward objects only exist
# after a wrap() call.
_RUN_EAGERLY: list[Callable[..., Any]] = []


def _is_compiled(m: torch.nn.Module) -> bool:
    return isinstance(m, torch._dynamo.eval_frame.OptimizedModule) or (
        getattr(m, "_compiled_call_impl", None) is not None
    )


def is_wrapped(module: torch.nn.Module) -> bool:
    """Whether ``wrap`` made ``module``'s forward run in a region."""
    return isinstance(module.__dict__.get("forward"), RegionForward)


def _matcher(match: Match | MatchFn) -> MatchFn:
    if isinstance(match, str):
        pattern = match
        return lambda name, _m: fnmatch.fnmatchcase(name, pattern)
    if isinstance(match, type) and issubclass(match, torch.nn.Module):
        cls = match
        return lambda _n, m: isinstance(m, cls)
    if isinstance(match, tuple) and all(
        isinstance(c, type) and issubclass(c, torch.nn.Module) for c in match
    ):
        classes = match
        return lambda _n, m: isinstance(m, classes)
    if callable(match) and not isinstance(match, type):
        fn: MatchFn = match
        return fn
    raise CkptGraphTypeError(
        "ckpt_graph: wrap(match=...) takes a module class (or tuple of classes), a "
        "qualified-name pattern such as 'layers.*', or a predicate (name, module) -> bool; "
        f"got {type(match).__name__}"
    )


def _select(
    model: torch.nn.Module, match: Match | MatchFn | None
) -> list[tuple[str, torch.nn.Module]]:
    """Selected ``(name, module)`` in ``named_modules`` order, skipping those inside a selected one."""
    pred: MatchFn
    if match is None:
        blocks = {
            id(child)
            for m in model.modules()
            if isinstance(m, torch.nn.ModuleList)
            for child in m.children()
        }

        def in_list(_name: str, m: torch.nn.Module) -> bool:
            return id(m) in blocks

        pred = in_list
    else:
        pred = _matcher(match)
    selected: list[tuple[str, torch.nn.Module]] = []
    prefixes: list[str] = []
    for name, m in model.named_modules():
        if any(name == p or name.startswith(p + ".") or p == "" for p in prefixes):
            continue  # See Note [Wrapping by instance forward] (4)
        if pred(name, m):
            selected.append((name, m))
            prefixes.append(name)
    return selected


def _names_hint(model: torch.nn.Module, most: int = 8) -> str:
    """The module names ``match`` could select in ``model``: its module lists as patterns
    (``'blocks.*'``), else its top-level children; never a name the model does not have."""
    lists = [
        f"{name + '.*'!r} ({len(m)} module{'s' if len(m) > 1 else ''})"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and name
    ]
    if lists:
        return f"its module lists match {', '.join(lists[:most])}"
    children = [name for name, _ in model.named_children()]
    if not children:
        return f"{type(model).__name__} has no submodules"
    more = f" and {len(children) - most} more" if len(children) > most else ""
    return f"its submodules are {', '.join(repr(n) for n in children[:most])}{more}"


def wrap(
    model: torch.nn.Module,
    policy: Any = "recompute_all",
    match: Match | MatchFn | None = None,
) -> torch.nn.Module:
    """Run the forward of selected submodules of ``model``, each in its own region.

    No module is replaced or inserted: parameters, buffers, ``state_dict()`` keys and
    module hooks are untouched (hooks run outside the region). See Note [Wrapping by
    instance forward]. Under ``torch.compile`` each region is lowered to torch's checkpoint
    with a selective-checkpoint policy asking ``policy``: no graph break (See Note [Wrapped
    modules under torch.compile]).

    Args:
        model: the model; it may itself be selected (``match=lambda name, m: name == ""``
            puts its whole forward in one region).
        policy: the region's policy, as for ``save_recompute_policy``. One
            ``policies.memory_budget`` object budgets the whole step: the blocks' regions
            are planned jointly (Note [Step budget across regions] in
            ``ckpt_graph/planner/step_budget.py``).
        match: which modules: ``None`` (default) for the repeated blocks, i.e. the children of
            every ``nn.ModuleList``; a module class or tuple of classes; a qualified-name
            pattern (``fnmatch`` syntax, e.g. ``"layers.*"`` or ``"*.mlp"``); or a predicate
            ``(qualified_name, module) -> bool``. A module inside another selected module is
            not wrapped again.

    Returns:
        ``model`` itself. Wrapping again is idempotent (an already wrapped module only takes
        the new ``policy``). Logs ``describe_wrapped(model)`` at INFO on the ``ckpt_graph``
        logger; the regions are labelled ``"ckpt_graph.wrap: <name> (<class>)"`` (See Note
        [Integrations say when they are active]).

    Raises:
        ValueError: nothing in ``model`` matched.
        TypeError: ``match`` has an unsupported type.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
        >>> model = ckpt_graph.wrap(model)          # each ModuleList child in a region
        >>> ckpt_graph.unwrap(model) is model
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise CkptGraphTypeError(
            f"ckpt_graph: wrap() takes an nn.Module, got {type(model).__name__}"
        )
    selected = _select(model, match)
    if not selected:
        what = "no nn.ModuleList children" if match is None else f"nothing matched {match!r}"
        raise CkptGraphValueError(
            f"ckpt_graph: wrap() found {what} in {type(model).__name__}; "
            f"{_names_hint(model)}. Pass match= a name pattern of these, a module class, or "
            "a predicate (name, module) -> bool"
        )
    if not _RUN_EAGERLY:
        from torch._dynamo import disable

        _RUN_EAGERLY.append(disable(_run_eagerly))
    for name, m in selected:
        compiled = [n for n, sub in m.named_modules() if _is_compiled(sub)]
        if compiled:
            warnings.warn(
                f"ckpt_graph: wrap() selected {type(m).__name__}, which contains compiled "
                f"submodules ({', '.join(repr(n) for n in compiled[:3])}); they run eagerly "
                "inside its region (dynamo skips frames while the region's TorchDispatchMode "
                "records); compile the model after wrap() instead",
                UserWarning,
                stacklevel=2,
            )
        current = m.__dict__.get("forward")
        if isinstance(current, RegionForward):
            current.policy = policy
        else:
            label = f"ckpt_graph.wrap: {name or '(the model)'} ({type(m).__name__})"
            m.forward = RegionForward(m, policy, current, label)  # type: ignore[method-assign]
    announce(describe_wrapped(model))  # See Note [Integrations say when they are active].
    return model


def describe_wrapped(model: torch.nn.Module) -> str:
    """One line saying which modules of ``model`` run in regions, and with which policy.

    Example:
        >>> describe_wrapped(cg.wrap(model))  # doctest: +SKIP
        "wrap: 12 modules (GPT2Block x12) of GPT2LMHeadModel run in regions (policy='recompute_all')"
    """
    wrapped = [m for m in model.modules() if is_wrapped(m)]
    if not wrapped:
        return f"wrap: no module of {type(model).__name__} runs in a region"
    policies = {describe_policy(m.__dict__["forward"].policy): None for m in wrapped}
    return (
        f"wrap: {describe_modules(wrapped)} of {type(model).__name__} run in regions "
        f"(policy={', '.join(policies)})"
    )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``wrap`` on ``model`` and all its submodules; returns ``model``.

    Example:
        >>> model = ckpt_graph.unwrap(ckpt_graph.wrap(model))
        >>> from ckpt_graph.wrap import is_wrapped
        >>> any(is_wrapped(m) for m in model.modules())
        False
    """
    for m in model.modules():
        current = m.__dict__.get("forward")
        if isinstance(current, RegionForward):
            if current.previous is None:
                del m.__dict__["forward"]
            else:
                m.forward = current.previous  # type: ignore[method-assign]
    return model
