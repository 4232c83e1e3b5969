"""How ``patch_torch_checkpoint`` reaches torch's checkpoint calls, however the name was bound.

# Note [Routing torch's checkpoint calls]
# Code reaches torch's checkpoint through ``torch.utils.checkpoint.checkpoint`` looked up at
# call time, a name bound at import (``from torch.utils.checkpoint import checkpoint``, as
# transformers does), a ``functools.partial`` of it (torch's ``checkpoint_wrapper``, used by
# torchtune and torchtitan), or torch's generator itself (the composable
# ``torch.distributed._composable.checkpoint``). Every one of them ends in three names that
# torch's module looks up in its own globals at call time:
#   ``_checkpoint_without_reentrant_generator`` (``checkpoint(..., use_reentrant=False)``),
#   ``CheckpointFunction`` (``use_reentrant=True``) and ``_checkpoint_hook`` (entered by the
#   generator around the forward; only the composable API reaches it without the first).
# While any block is entered in the process these three are replaced, and torch's are put back
# when the last block has left; the public functions are never touched. Rules:
#   1. One decision per call, at its start: a region with a block's policy, or torch's own
#      implementation. A call follows the innermost block its thread entered, else the block
#      entered last in the process (threads that entered none, e.g. ``nn.DataParallel``'s).
#      Keywords torch passes on to the function (``policy=`` included) reach it unchanged; the
#      region's policy comes only from the block. torch's own keywords are translated as by
#      ``ckpt_graph.checkpoint`` (See Note [checkpoint as a drop-in for torch's]).
#   2. A call made directly inside the forward of a torch checkpoint that ran torch's
#      implementation (a *frame*) runs again when torch replays the frame in backward, maybe
#      after the block has left, or inside another one. The decision changes what the frame
#      saves (torch's nested checkpoint saves its inputs through the frame's hooks, a region
#      keeps them itself), and torch rejects a replay that saves differently. So the frame
#      records the decisions of its direct calls in order, and its replay takes, position by
#      position, the decision its forward took (the replacements are installed for the replay).
#   3. The frame is found from the pack hook on top of autograd's saved-tensor hooks: torch's
#      ``_checkpoint_hook`` during its forward, ``_recomputation_hook`` during its replay.
#      A frame whose forward began before the replacements were installed has no record (its
#      earlier calls went to torch unseen): the calls in it run torch's implementation, with a
#      warning, and so does its replay. The replacements stay installed while a frame that has
#      a record runs its forward, so that no call in it goes unseen.
#   4. While compiling (dynamo, or a proxy-tracing dispatch mode) torch's checkpoint is lowered
#      by the compiler as its higher-order op: such calls run torch's, with a warning.
#   5. Under ``torch.no_grad()`` a routed call runs the function as is (torch's saves nothing
#      either).
#   6. The one process-wide state is torch's module itself: the entered blocks, and the count
#      of users of the replacements, live in ``_Router`` under a lock (the blocks hold their
#      policies); decisions recorded for a frame live on the frame and die with it.
"""

from __future__ import annotations

import contextlib
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils import checkpoint as torch_checkpoint

from ckpt_graph._errors import CkptGraphError, CkptGraphValueError
from ckpt_graph.engine.api import save_recompute_policy
from ckpt_graph.engine.torch_sac import TorchSACPolicy, policy_from_context_fn
from ckpt_graph.integrations.activity import labelled_region

__all__ = [
    "FORWARD_PACK",
    "REPLAY_PACK",
    "Block",
    "enter_block",
    "exit_block",
    "installed",
]

_GENERATOR = "_checkpoint_without_reentrant_generator"
_FUNCTION = "CheckpointFunction"
_HOOK = "_checkpoint_hook"
_CALLS_ATTR = "_ckpt_graph_calls"  # set on torch's _CheckpointFrame objects

# torch's own objects, as imported: the replacements delegate to them.
_TORCH_GENERATOR: Callable[..., Any] = getattr(torch_checkpoint, _GENERATOR)
_TORCH_FUNCTION: Any = getattr(torch_checkpoint, _FUNCTION)
_TORCH_HOOK: Any = getattr(torch_checkpoint, _HOOK)

_UNSEEN_FRAME = (
    "ckpt_graph: a torch.utils.checkpoint call inside patch_torch_checkpoint ran torch's own "
    "checkpoint, because it was made inside a torch checkpoint whose forward began before the "
    "patch was entered (its replay in backward must take the same path); its gradients and "
    "memory are torch's. Enter the patch around the outer call as well"
)
_UNTRANSLATABLE = (
    "ckpt_graph: a torch.utils.checkpoint call inside patch_torch_checkpoint ran torch's own "
    "checkpoint, because its context_fn={name} returned contexts other than torch's "
    "selective checkpointing pair (create_selective_checkpoint_contexts), which a region cannot "
    "take the place of; its gradients and memory are torch's"
)
_COMPILING = (
    "ckpt_graph: a torch.utils.checkpoint call inside patch_torch_checkpoint ran torch's own "
    "checkpoint, because it was compiled (torch.compile lowers its checkpoint itself); its "
    "gradients and memory are torch's. Call ckpt_graph.wrap on the modules instead: a wrapped "
    "module compiles as a region whose policy the compiler asks per op"
)


class Block(Protocol):
    """What the router needs of an entered ``patch_torch_checkpoint`` block."""

    policy: Any
    calls: int


class _FrameCalls:
    """The decisions of the calls made directly in one torch frame's forward, in order.

    See Note [Routing torch's checkpoint calls], rule 2.
    """

    __slots__ = ("decisions", "position")

    def __init__(self) -> None:
        self.decisions: list[Block | None] = []
        self.position = 0  # the next call of the replay running now

    def replayed(self) -> Block | None:
        """The decision of the replay's next call: the forward's at the same position."""
        i = self.position
        self.position += 1
        return self.decisions[i] if i < len(self.decisions) else None


class _Router:
    """The process-wide state of the patch. See Note [Routing torch's checkpoint calls], rule 6."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # entered blocks + frames running a forward or replay that need them
        self.saved: dict[str, Any] = {}  # torch's objects while the replacements are installed
        self.blocks: list[Block] = []  # entered blocks of all threads, in order of entry
        self.local = threading.local()  # .blocks: the thread's entered blocks; .delegated

    def acquire(self) -> None:
        with self.lock:
            if self.users == 0:
                replacements = _replacements()
                self.saved = {name: getattr(torch_checkpoint, name) for name in replacements}
                for name, value in replacements.items():
                    setattr(torch_checkpoint, name, value)
            self.users += 1

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                for name, value in self.saved.items():
                    setattr(torch_checkpoint, name, value)
                self.saved = {}

    def thread_blocks(self) -> list[Block]:
        blocks: list[Block] | None = getattr(self.local, "blocks", None)
        if blocks is None:
            blocks = self.local.blocks = []
        return blocks

    def current(self) -> Block | None:
        """The block a call in this thread follows (rule 1)."""
        own = self.thread_blocks()
        if own:
            return own[-1]
        with self.lock:
            return self.blocks[-1] if self.blocks else None


_ROUTER = _Router()


def enter_block(block: Block) -> list[Block]:
    """Make ``block`` route this thread's calls (and those of threads that entered none).

    Returns the list to hand to ``exit_block`` (the entering thread's blocks).
    """
    own = _ROUTER.thread_blocks()
    _ROUTER.acquire()
    with _ROUTER.lock:
        _ROUTER.blocks.append(block)
    own.append(block)
    return own


def exit_block(block: Block, own: list[Block]) -> None:
    """Undo ``enter_block``, in any order relative to other blocks and threads."""
    for i in range(len(own) - 1, -1, -1):
        if own[i] is block:
            del own[i]
            break
    with _ROUTER.lock:
        for i in range(len(_ROUTER.blocks) - 1, -1, -1):
            if _ROUTER.blocks[i] is block:
                del _ROUTER.blocks[i]
                break
    _ROUTER.release()


def installed() -> bool:
    """Whether torch's checkpoint internals are replaced now (for tests and introspection)."""
    return getattr(torch_checkpoint, _HOOK) is not _TORCH_HOOK


# ------------------------------------------------------------------ finding the frame
def _pack_code(hook_class: Any) -> types.CodeType | None:
    """The code of the ``pack_hook`` a torch hook class defines in its ``__init__``."""
    init = getattr(hook_class, "__init__", None)
    for const in getattr(getattr(init, "__code__", None), "co_consts", ()):
        if isinstance(const, types.CodeType) and const.co_name == "pack_hook":
            return const
    return None


# The code of torch's pack hooks in forward and in its recompute: a pack hook whose code is
# one of these leads to torch's frame (tests pin that torch still defines them).
FORWARD_PACK = _pack_code(_TORCH_HOOK)
REPLAY_PACK = _pack_code(getattr(torch_checkpoint, "_recomputation_hook", None))


def _closure(fn: Any, name: str) -> Any:
    """The value of the free variable ``name`` of function ``fn`` (``None`` if unset)."""
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    try:
        return fn.__closure__[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _enclosing_frame() -> tuple[Any, bool] | None:
    """The torch frame whose forward (``False``) or replay (``True``) a call is made in.

    See Note [Routing torch's checkpoint calls], rule 3.
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return None
    pack = getattr(top[0], "__wrapped__", top[0])  # the replay's pack hook is dynamo-disabled
    code = getattr(pack, "__code__", None)
    if code is None or code not in (FORWARD_PACK, REPLAY_PACK):
        return None
    if code is FORWARD_PACK:
        return _closure(pack, "frame"), False
    frame = _closure(pack, "target_frame_ref")()
    return (frame, True) if frame is not None else None


# ------------------------------------------------------------------ deciding
def _compiling() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _decide(context_fn: Any = None) -> tuple[Block | None, TorchSACPolicy | None]:
    """The block whose region a call runs in (``None``: torch's implementation), and the
    inner policy that the call's ``context_fn`` translates to."""
    block = _ROUTER.current()
    if _compiling():  # rule 4
        if block is not None:
            warnings.warn(_COMPILING, UserWarning, stacklevel=1)
        return None, None
    found = _enclosing_frame()
    frame, calls = None, None
    if found is not None:
        frame, replaying = found
        calls = getattr(frame, _CALLS_ATTR, None)
        if replaying:  # rule 2
            block = calls.replayed() if calls is not None else None
            return block, (_translated(context_fn)[1] if block is not None else None)
        if calls is None:  # rule 3: a frame begun before the replacements
            if block is not None:
                warnings.warn(_UNSEEN_FRAME, UserWarning, stacklevel=1)
            return None, None
    inner = None
    if block is not None:
        translatable, inner = _translated(context_fn)
        if not translatable:  # rule 1
            name = getattr(context_fn, "__qualname__", repr(context_fn))
            warnings.warn(_UNTRANSLATABLE.format(name=name), UserWarning, stacklevel=1)
            block = None
    if calls is not None:
        if block is not None and not any(d is not None for d in calls.decisions):
            _replay_with_routing(frame, calls)
        calls.decisions.append(block)
    return block, inner


def _replay_with_routing(frame: Any, calls: _FrameCalls) -> None:
    """Make the frame's replay run with the replacements installed, from position 0."""
    torch_replay = frame.recompute_fn

    def recompute_fn(*args: Any) -> None:
        calls.position = 0
        _ROUTER.acquire()
        try:
            torch_replay(*args)
        finally:
            _ROUTER.release()

    frame.recompute_fn = recompute_fn


# ------------------------------------------------------------------ running a routed call
def _label(fn: Any) -> str:
    target = getattr(fn, "func", fn)  # functools.partial (torch's checkpoint_wrapper, HF)
    owner = getattr(target, "__self__", None)
    if isinstance(target, torch.nn.Module) or isinstance(owner, torch.nn.Module):
        name = type(owner if owner is not None else target).__name__
    else:
        name = getattr(target, "__qualname__", type(target).__name__)
    return f"patch_torch_checkpoint: {name}"


def _translated(context_fn: Any) -> tuple[bool, TorchSACPolicy | None]:
    """Whether a region can take the place of ``context_fn``'s contexts, and the policy.

    torch's no-op pair and a pair whose forward context is a ``nullcontext`` (the composable
    ``checkpoint(module)`` without user contexts) need none; torch's selective checkpointing
    pair becomes an inner policy (Note [checkpoint as a drop-in for torch's]); others cannot.
    """
    if context_fn is None or context_fn is torch_checkpoint.noop_context_fn:
        return True, None
    contexts = context_fn()
    if isinstance(contexts, tuple) and isinstance(contexts[0], contextlib.nullcontext):
        return True, None
    try:
        return True, policy_from_context_fn(lambda: contexts)
    except CkptGraphError:
        return False, None


@contextlib.contextmanager
def _region(block: Block, fn: Any, inner: Any = None, debug: bool = False) -> Iterator[None]:
    """The region of one routed call, with torch's SAC policy ``inner`` pushed if given."""
    block.calls += 1
    with labelled_region(block.policy, _label(fn), debug=debug):
        if inner is None:
            yield
        else:
            with save_recompute_policy(inner):
                yield


def _generator(
    fn: Any,
    preserve_rng_state: bool = True,
    context_fn: Any = torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    *args: Any,
    **kwargs: Any,
) -> Iterator[None]:
    """Replaces torch's ``_checkpoint_without_reentrant_generator`` (same protocol: torch's
    ``checkpoint`` calls ``next`` before and after running ``fn``, ``throw`` if it raised)."""
    block, inner = _decide(context_fn)
    if block is None:
        gen = _TORCH_GENERATOR(
            fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop,
            *args, **kwargs,
        )  # fmt: skip
        _ROUTER.local.delegated = True  # its _checkpoint_hook needs no second decision
        try:
            next(gen)
        finally:
            _ROUTER.local.delegated = False
        try:
            yield
        except BaseException as exc:
            gen.throw(exc)
            raise
        with contextlib.suppress(StopIteration):
            next(gen)
        return
    if determinism_check not in ("default", "none"):
        raise CkptGraphValueError(
            f"ckpt_graph: torch.utils.checkpoint(determinism_check={determinism_check!r}) "
            "inside patch_torch_checkpoint: pass 'default' or 'none', as torch takes"
        )
    if not torch.is_grad_enabled():  # rule 5
        yield
        return
    with _region(block, fn, inner, debug):
        yield


class _RoutedCheckpointFunction(_TORCH_FUNCTION):  # type: ignore[misc,valid-type]
    """Replaces torch's ``CheckpointFunction`` (the reentrant variant): ``apply`` decides."""

    @classmethod
    def apply(cls, function: Any, preserve_rng_state: bool, *args: Any) -> Any:  # type: ignore[override]
        block, _ = _decide()
        if block is None:
            return _TORCH_FUNCTION.apply(function, preserve_rng_state, *args)
        if not torch.is_grad_enabled():  # rule 5
            return function(*args)
        with _region(block, function):
            return function(*args)


class _ObservedFrameHook:
    """torch's ``_checkpoint_hook`` for a frame that records its direct calls' decisions,
    holding the replacements installed during the frame's forward (rule 3)."""

    __slots__ = ("_hook",)

    def __init__(self, frame: Any) -> None:
        setattr(frame, _CALLS_ATTR, _FrameCalls())
        self._hook = _TORCH_HOOK(frame)

    def __enter__(self) -> None:
        _ROUTER.acquire()
        try:
            self._hook.__enter__()
        except BaseException:
            _ROUTER.release()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self._hook.__exit__(*exc)
        finally:
            _ROUTER.release()


def _hook(frame: Any) -> Any:
    """Replaces torch's ``_checkpoint_hook``: for calls that reached torch's generator
    without ``_generator`` (the composable ``checkpoint(module)``) it decides here."""
    if getattr(_ROUTER.local, "delegated", False):
        _ROUTER.local.delegated = False
        return _ObservedFrameHook(frame)
    block, _ = _decide()  # torch's generator enters the call's forward context in the region
    if block is None:
        return _ObservedFrameHook(frame)
    return _region(block, _closure(frame.recompute_fn, "fn"))


def _replacements() -> dict[str, Any]:
    return {_GENERATOR: _generator, _FUNCTION: _RoutedCheckpointFunction, _HOOK: _hook}
