"""Replay: run a recorded op again as the forward ran it, random ops with the generator
state captured when they were recorded (``capture_rng``).

# Note [RNG replay]
# Random ops (``torch.Tag.nondeterministic_seeded``) record the state of their generator
# just before they ran in forward: the explicit ``generator=`` argument's, or else the
# default generator of their device. Replaying sets that state, runs the op and restores
# the state the generator had, so recomputed values equal the forward's and the user's
# random stream ends where it would have without checkpointing. A state equal to the one
# the previous random op captured (the op drew nothing: SDPA without dropout) is shared, not
# copied; a CPU generator state is 5 KiB, held until the op can no longer run (see Note
# [Releasing kept values]). On a device whose default generator the engine
# cannot address (``capture_rng`` returns ``None``), the outputs of a random op are
# kept for the engine reason ``RANDOM_WITHOUT_REPLAY``, which no policy or tag overrides.
#
# Replay context (``enter_replay``, for ``realize`` and ``realize_again``): no grad
# (unpacked values must be plain tensors; autograd re-attaches them to the original graph,
# which also makes ``create_graph=True`` work), autocast off (the recorded ops already carry
# the casts autocast made), nothing recorded, the forward's settings (Note [Replay globals]).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch._ops import OpOverload

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode
    from ckpt_graph.engine.region import Region

__all__ = [
    "REPLAY_GLOBALS",
    "Replay",
    "capture_rng",
    "enter_replay",
    "exact_copy",
    "exit_replay",
    "fresh_alias",
    "note_recompute_failure",
    "replay_globals",
    "replay_op",
]


def exact_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same sizes, strides and storage offset, in new storage."""
    with torch.no_grad():
        if (
            t.is_contiguous()
            and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        ):
            return t.clone()
        storage = t.untyped_storage().clone()
        return torch.empty((0,), dtype=t.dtype, device=t.device).set_(
            storage, t.storage_offset(), t.size(), t.stride()
        )


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


_set_grad_enabled = torch._C._set_grad_enabled
_is_any_autocast_enabled = torch._C._is_any_autocast_enabled

# Note [Replay globals]
# Besides arguments, an op's result can depend on process-wide settings: the number of
# intra-op threads (a CPU reduction sums in chunks per thread: ``x.sum()`` of 10^6 values
# differs in the last bits between 1 and 2 threads), ``torch.use_deterministic_algorithms``
# (kernel choice, and NaN-filled ``empty``), ``torch.set_float32_matmul_precision``
# (reduced-precision matmul kernels) and whether oneDNN is enabled. A backward may run
# under other settings than its forward (a data loader thread changing the thread count,
# a test toggling determinism), so the region reads them when it opens (``Region.forward_globals``)
# and recompute runs under those (``_replay_globals``): each differing one is set for the
# duration of a ``realize`` and restored after. Changing one inside an open region would
# leave ops of one region with two settings: closing the region then raises (see
# ``close_region``). The default dtype is one of them too: besides factory ops,
# which record the dtype, layout and device they produced (Note [Factory ops] in
# record.py), it sets the result dtype of ops that promote integers to floating point
# (``idx * 0.1``, ``idx / 3``, ``idx.sigmoid()``), whose replay under another default gave
# float64 values where the forward had float32. Recompute runs with autocast off and no
# grad, whatever the backward has (the recorded ops carry autocast's casts, and grad mode
# does not change values).
REPLAY_GLOBALS: tuple[tuple[str, Any, Any], ...] = (
    (
        "torch.use_deterministic_algorithms",
        lambda: (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
    ),
    (
        "torch.set_float32_matmul_precision",
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    ),
    ("torch.backends.mkldnn.enabled", torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled),
    ("torch.set_num_threads", torch.get_num_threads, torch.set_num_threads),
    ("torch.set_default_dtype", torch.get_default_dtype, torch.set_default_dtype),
)


def replay_globals() -> tuple[Any, ...]:
    """The current values of the settings in ``REPLAY_GLOBALS``."""
    return tuple(get() for _, get, _ in REPLAY_GLOBALS)


@contextlib.contextmanager
def _replay_globals(region: Region) -> Iterator[None]:
    """Run under the settings the region's forward had. See Note [Replay globals]."""
    want = region.forward_globals
    now = replay_globals()
    if want is None or now == want:
        yield
        return
    changed = [(i, now[i]) for i in range(len(now)) if now[i] != want[i]]
    for i, _ in changed:
        REPLAY_GLOBALS[i][2](want[i])
    try:
        yield
    finally:
        for i, v in changed:
            REPLAY_GLOBALS[i][2](v)


# What enter_replay saved for exit_replay: recording on, grad mode, autocast and settings managers.
Replay = tuple[bool, bool, Any, Any]


def enter_replay(region: Region) -> Replay:
    """Enter the replay context (see Note [Realize order]): nothing recorded, no grad, no
    autocast, the forward's settings. Returns what :func:`exit_replay` restores.

    Plain functions rather than a context manager: this runs once per unpack that
    recomputes, where a generator-based manager costs measurable time.
    """
    state = region.recording
    recording = state.on  # False inside a policy's call, even in an open region
    state.on = False
    grad_was = torch.is_grad_enabled()
    _set_grad_enabled(False)
    autocast = _autocast_off() if _is_any_autocast_enabled() else None
    if autocast is not None:
        autocast.__enter__()
    settings = _replay_globals(region)
    settings.__enter__()
    return recording, grad_was, autocast, settings


def exit_replay(region: Region, replay: Replay) -> None:
    """Leave the replay context entered by :func:`enter_replay`."""
    recording, grad_was, autocast, settings = replay
    settings.__exit__(None, None, None)
    if autocast is not None:
        autocast.__exit__(None, None, None)
    _set_grad_enabled(grad_was)
    region.recording.on = recording


def fresh_alias(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` (same storage and geometry) with a version counter of its own."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        alias = t.as_strided(t.size(), t.stride(), t.storage_offset())
    return alias


# Note [Ops that read grad mode]
# A few kernels decide from grad mode whether to return what their backward needs: on CPU
# ``mkldnn_rnn_layer`` (nn.LSTM) returns its workspace only with grad enabled. The forward
# ran them with grad enabled; recompute runs with grad disabled (see the replay context),
# so these ops run with grad enabled again, below autograd (no graph is built).
_GRAD_MODE_OPS = frozenset(
    op
    for name in ("mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn")
    if (op := getattr(getattr(torch.ops.aten, name, None), "default", None)) is not None
)


_GRAD_MODE_IDS = frozenset(id(op) for op in _GRAD_MODE_OPS)  # OpOverload.__hash__ is Python


def replay_op(node: OpNode, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Run ``node``'s op on ``args`` as the forward ran it: random ops from the generator
    state they recorded (Note [RNG replay]), grad-mode readers with grad enabled (Note [Ops
    that read grad mode]).
    """
    op: Any = node.op
    if id(op) in _GRAD_MODE_IDS:
        with torch._C._AutoDispatchBelowAutograd(), torch.enable_grad():
            return op(*args, **kwargs)
    if type(op) is OpOverload:
        op = op._op  # the C++ op: ``OpOverload.__call__`` only forwards to it
    if node.rng is None:
        return op(*args, **kwargs)
    gen, state = node.rng
    before = gen.get_state()
    gen.set_state(state)
    try:
        return op(*args, **kwargs)
    finally:
        gen.set_state(before)


# Note [Errors raised by a recomputed op]
# An op that raises while it is recomputed in backward (out of memory, a kernel that
# rejects its inputs) raises its own exception, not one of the library's: a training loop
# that catches ``torch.OutOfMemoryError`` to retry with a smaller batch must see it, and
# ``CkptGraphError`` is kept for what the library itself detects (Note [Error types]). The
# exception gets a note (``add_note``, shown under the traceback) naming the op, its
# position in the region's forward and module, and what to do if the op's inputs were
# modified in place after the forward. Every path that replays an op adds it: ``run_node``
# and ``realize_again``.


def note_recompute_failure(e: BaseException, node: OpNode) -> None:
    """Add to ``e`` which recomputed op raised it. See Note [Errors raised by a recomputed
    op]."""
    where = f" in module {node.module_path!r}" if node.module_path else ""
    e.add_note(
        f"ckpt_graph: raised while recomputing op #{node.index} {node.info.name} (position "
        f"{node.index} of the region's forward{where}) in backward. If its inputs were "
        "modified in place after the forward, keep this op's output (tag_with_policy(t, True)) "
        "or avoid the modification."
    )


def capture_rng(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Generator, torch.Tensor] | None:
    """Generator state just before a random op runs. See Note [RNG replay]."""
    gen = kwargs.get("generator")
    if gen is None:
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "cpu":
            gen = torch.default_generator
        elif device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            gen = torch.cuda.default_generators[idx]
        else:
            return None  # no replay known for this device: outputs are kept
    state = gen.get_state()
    # See Note [RNG replay]: consecutive random ops that left the generator as it was (SDPA
    # without dropout, dropout(p=0)) share one state tensor instead of holding a copy each.
    last_gen, last_state = _LAST_RNG
    if last_gen is not None and last_gen() is gen:
        last = last_state()
        if last is not None and _same(last, state):
            return gen, last
    _LAST_RNG[:] = [weakref.ref(gen), weakref.ref(state)]
    return gen, state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Below every dispatch mode: the caller's own modes (an op counter, a profiler) must not
    # see the engine's bookkeeping as ops of the program.
    with torch._C._DisableTorchDispatch():
        return torch.equal(a, b)


# The generator and the state tensor of the last capture, weakly held (a region owns them).
_LAST_RNG: list[Any] = [None, None]
