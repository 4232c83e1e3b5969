"""save_module_outputs: keep what selected modules return, recompute everything else.

One region over a whole model plus ``save_module_outputs(Block)`` gives per-block
checkpointing; a predicate that picks every k-th block gives sqrt(N)-style checkpointing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any, TypeAlias

import torch
from torch import nn
from torch._ops import OpOverload
from torch.utils import _pytree
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.hooks import RemovableHandle

from ckpt_graph._errors import CkptGraphTypeError
from ckpt_graph.policies.builtins import Answer, Policy

__all__ = ["ModuleMatch", "name_matches", "save_module_outputs", "tag_outputs"]

ModuleMatch: TypeAlias = (
    type[nn.Module] | tuple[type[nn.Module], ...] | str | Callable[[str, nn.Module], bool]
)
"""How save_module_outputs selects modules: type(s), a name pattern, or a predicate."""

# Note [Module outputs from module hooks]
#
# A policy sees ops, not module returns: when an op runs, nobody knows yet whether its output
# will be what the running module returns. So the decision is taken when the module returns,
# by tagging: while a region using the policy is open in a thread, the policy has a global
# forward pre-hook and forward hook installed (torch.nn.modules.module.register_module_*),
# that keep a stack of (module, qualified name) for the modules running in that thread, and on
# return of a selected module tag every tensor in its output with MUST_SAVE via
# ckpt_graph.tag_with_policy. Every op gets PREFER_RECOMPUTE (the "rest").
#
# 1. Hooks are installed by on_region_enter and removed by on_region_exit (optional methods the
#    engine calls on policy objects); each thread has its own hooks, which ignore calls from
#    other threads, so regions in different threads stay independent.
# 2. Qualified names are what ctx.module_path says (see Note [Module path tracking] in
#    ckpt_graph/engine/modules.py). The engine's module hooks are installed when the region opens,
#    before on_region_enter, so they run first: the pre-hook reads the name the engine gave
#    the module it just pushed. Without an engine region (direct use of the hooks) the same
#    rule is applied locally: names from named_modules() of the outermost module called while
#    the policy is active, which is "", and a module outside it named after its class.
# 3. The hook runs with always_call=True so that a forward that raises still pops the stack.


def _split(name: str) -> list[str]:
    return name.split(".") if name else []


def _glob(pattern: list[str], name: list[str]) -> bool:
    """Match dotted-name segments: fnmatch within a segment, ``**`` for any number of them."""
    if not pattern:
        return not name
    head = pattern[0]
    if head == "**":
        return any(_glob(pattern[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatchcase(name[0], head) and _glob(pattern[1:], name[1:])


def name_matches(pattern: str, name: str) -> bool:
    """Whether the qualified module ``name`` matches ``pattern`` as ``save_module_outputs``
    reads it: fnmatch per dot-separated segment, ``**`` for any number of segments.

    Example:
        >>> name_matches("**.mlp", "layers.3.mlp"), name_matches("layers.*", "layers.0.mlp")
        (True, False)
    """
    return _glob(_split(pattern), _split(name))


def _compile(match: ModuleMatch) -> tuple[Callable[[str, nn.Module], bool], str]:
    """Return (predicate on (qualified_name, module), text for the repr)."""
    if isinstance(match, type):
        if not issubclass(match, nn.Module):
            raise CkptGraphTypeError(
                f"ckpt_graph: save_module_outputs: {match.__name__} is not an nn.Module subclass"
            )
        cls = match
        return (lambda name, module: isinstance(module, cls)), match.__name__
    if isinstance(match, tuple):
        if not match or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in match):
            raise CkptGraphTypeError(
                f"ckpt_graph: save_module_outputs: a tuple must hold nn.Module subclasses, got {match!r}"
            )
        classes = match
        text = (
            "(" + ", ".join(c.__name__ for c in classes) + ("," if len(classes) == 1 else "") + ")"
        )
        return (lambda name, module: isinstance(module, classes)), text
    if isinstance(match, str):
        pattern = match
        memo: dict[str, bool] = {}

        def by_name(name: str, module: nn.Module) -> bool:
            hit = memo.get(name)
            if hit is None:
                hit = memo[name] = name_matches(pattern, name)
            return hit

        return by_name, repr(match)
    if callable(match):
        return match, getattr(match, "__qualname__", None) or repr(match)
    raise CkptGraphTypeError(
        "ckpt_graph: save_module_outputs: match must be an nn.Module subclass, a tuple of them, a name "
        f"pattern or a predicate (qualified_name, module) -> bool, got {match!r}"
    )


class _ThreadState:
    """Per-thread hook state of one save_module_outputs object.

    Invariants:
        ``handles`` is non-empty exactly when ``depth > 0``; ``stack`` holds the modules whose
        forward is running in this thread and started while the hooks were installed.
    """

    __slots__ = ("depth", "handles", "names", "root", "stack")

    def __init__(self) -> None:
        self.depth = 0
        self.handles: list[RemovableHandle] = []
        self.stack: list[list[Any]] = []  # [module, qualified name]
        self.root: nn.Module | None = None
        self.names: dict[int, str] = {}  # id(submodule of root) -> qualified name

    def name_of(self, module: nn.Module) -> str:
        """Qualified name of a module about to run. See Note [Module outputs from module hooks]."""
        from ckpt_graph.engine.region import current_region  # late: region imports this package

        region = current_region()
        modules = region.module_stack if region is not None else None
        if modules is not None and modules.current() is module:
            return str(modules.path())  # the engine's name: what ctx.module_path says
        if not self.stack and module is not self.root:
            self.root = module
            self.names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
        name = self.names.get(id(module))
        return name if name is not None else type(module).__name__


class save_module_outputs(Policy):
    """Keep the outputs of selected modules (MUST_SAVE tags); recompute every op (PREFER).

    Args:
        match: which modules' outputs to keep:

            * an ``nn.Module`` subclass or a tuple of them (``isinstance``);
            * a qualified-name pattern (``str``), matched per dot-separated segment with
              fnmatch (``*``, ``?``, ``[0-3]`` stay within one segment) and ``**`` for any
              number of segments: ``"layers.*"`` matches ``layers.0`` but not
              ``layers.0.mlp``; ``"**.mlp"`` matches every ``mlp``; an exact name matches
              itself. Names are relative to the outermost module called in the region, which
              is ``""`` (see ``ctx.module_path``);
            * a predicate ``(qualified_name, module) -> bool``.

    Note:
        Every op answers PREFER_RECOMPUTE and the outputs are tagged MUST_SAVE when the module
        returns; see Note [Built-in policy strengths] and Note [Module outputs from module
        hooks]. The engine must call ``on_region_enter`` / ``on_region_exit``.

    Known limitations:
        Only modules whose forward starts while the policy is active are seen. Tensors a
        module returns that the region did not produce (parameters, region inputs) are tagged
        like any other; the engine keeps region inputs anyway.

    Example:
        >>> every_4th = save_module_outputs(
        ...     lambda name, m: isinstance(m, Block) and int(name.rsplit(".", 1)[-1]) % 4 == 0
        ... )  # doctest: +SKIP
        >>> with cg.save_recompute_policy(every_4th):  # doctest: +SKIP
        ...     y = gpt(x)
        >>> save_module_outputs("layers.*")
        save_module_outputs('layers.*')
    """

    def __init__(self, match: ModuleMatch) -> None:
        self._match, self._text = _compile(match)
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        # Hook state belongs to the threads running regions now; a copy starts without it.
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _state(self) -> _ThreadState:
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState()
        return state

    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        return CheckpointPolicy.PREFER_RECOMPUTE

    def on_region_enter(self, region: Any) -> None:
        """Install this thread's module hooks (called by the engine)."""
        state = self._state()
        state.depth += 1
        if state.depth == 1:
            owner = threading.get_ident()
            state.handles = [
                nn.modules.module.register_module_forward_pre_hook(
                    self._make_pre_hook(state, owner)
                ),
                nn.modules.module.register_module_forward_hook(
                    self._make_post_hook(state, owner), always_call=True
                ),
            ]

    def on_region_exit(self, region: Any) -> None:
        """Remove this thread's module hooks once the last region using them closes."""
        state = self._state()
        if state.depth == 0:
            return
        state.depth -= 1
        if state.depth == 0:
            for handle in state.handles:
                handle.remove()
            state.handles = []
            state.stack.clear()
            state.root = None
            state.names = {}

    def _make_pre_hook(self, state: _ThreadState, owner: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if threading.get_ident() != owner:
                return
            state.stack.append([module, state.name_of(module)])

        return pre_hook

    def _make_post_hook(self, state: _ThreadState, owner: int) -> Callable[..., None]:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() != owner:
                return
            stack = state.stack
            # Pop to this module: entries above it belong to forwards that raised.
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] is module:
                    name = stack[i][1]
                    del stack[i:]
                    break
            else:
                return  # started before the hooks were installed
            if self._match(name, module):
                tag_outputs(output)

        return post_hook

    def _repr_args(self) -> str:
        return self._text


def tag_outputs(output: Any) -> None:
    """Tag every tensor in a module's ``output`` MUST_SAVE (``tag_with_policy``)."""
    from ckpt_graph.engine.api import tag_with_policy  # late: region imports this package

    for leaf in _pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            tag_with_policy(leaf, CheckpointPolicy.MUST_SAVE)
