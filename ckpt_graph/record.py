"""The recorder: a ``TorchDispatchMode`` that turns every aten op of a region into an op node.

# Note [Mutation and views]
# Every tensor the region sees maps to the handle of the value it holds *now*
# (``Region.handle_of``): an identity map ``id(tensor) -> Handle`` whose entries are
# validated by a weak reference (ids are reused) and by the tensor's version counter.
#   1. An op whose schema writes an argument (``alias_info.is_write``, plus the few ops in
#      ``graph._UNANNOTATED_WRITES`` such as CPU ``native_batch_norm``) creates a new
#      version: the returned tensor maps to the new op node's output handle, and the old
#      handle is marked ``superseded`` so that a saved tensor of the old value raises
#      autograd's version-counter error when unpacked, as eager does.
#   2. Written arguments that the op does not return (running statistics) are dropped
#      from the map: their next use takes the tensor as it is (a kept snapshot).
#   3. A tensor whose version changed through another alias (``x[0:2].mul_(3)`` changes
#      ``x``) no longer matches its handle; its next use takes it as a kept snapshot
#      (reason ``MUTATED_ALIAS``). Correct, and rare in models; deriving the new value by
#      replaying view ops on the new base would avoid keeping it.
#   4. Kept values are shared with the forward tensors. Before an op writes a storage,
#      every kept value in that storage that some op node or saved tensor already used is
#      replaced by an exact copy (same storage offset and strides), because the write would
#      change it under them. A kept value the op overwrites with nobody else needing it is
#      not copied; its new version is kept instead (``INPLACE_ON_KEPT``), which costs no
#      memory since it is the same tensor.
#   5. The version of an in-place op's output (bumped) and of a view op's output (shared
#      with its base) is only set by autograd after this mode returns: those handles start
#      at -1 and read the tensor's version when the region next sees anything
#      (``Region._settle``), before any other op can change it.
# Replaying a recorded write in backward follows the same rule from the other side: it runs
# on the cached value itself only when that value is recomputed, not a view, has no views
# and this op is its last pending user (dropout's ``empty_like -> bernoulli_ -> div_``);
# otherwise on an exact copy (see ``realize.run_node``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .graph import _OP_INFO, op_info

if TYPE_CHECKING:
    from .region import Region

__all__ = ["Recorder"]

_current_task = torch._C._current_graph_task_id
try:  # dynamo's per-thread frame callback (C functions; no import of torch._dynamo)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # pragma: no cover - builds without dynamo

    def _dynamo_callback() -> Any:  # type: ignore[misc]
        return None

    def _set_eval_frame(callback: Any) -> Any:  # type: ignore[misc]
        return None


_ONES_LIKE = torch.ops.aten.ones_like.default


def _seed_gradient() -> bool:
    """Whether ``ones_like`` is autograd making the implicit seed gradient of a backward."""
    frame: Any = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == "_make_grads":
            return True
        frame = frame.f_back
    return False


class Recorder(TorchDispatchMode):
    """Records the aten ops of one region. Entered and exited by the region."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in torch._disable_dynamo by default, which costs
        # microseconds per op. The recorder only needs it while dynamo's frame callback is
        # set in this thread (a compiled caller: dynamo would compile the recorder's own
        # frames), and checks that itself in a few nanoseconds.
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if _dynamo_callback() is not None:
            prior = _set_eval_frame(None)
            try:
                return _record_op(self.region, func, args, kwargs)
            finally:
                _set_eval_frame(prior)
        return _record_op(self.region, func, args, kwargs)


def _record_op(region: Region, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Backward run inside the region, and the region's own recompute, are not recorded.
    if (
        not region._recording
        or _current_task() != region._task
        or (func is _ONES_LIKE and _seed_gradient())
    ):
        return func(*args, **kwargs)
    if region._unsettled:
        region._settle()
    info = _OP_INFO.get(func) or op_info(func)
    h_args, h_kwargs, inputs = region._scan(args, kwargs)
    overwritten = (
        region._before_write(info, args, kwargs, h_args, h_kwargs) if info.writes else None
    )
    rng = region._capture_rng(args, kwargs) if info.is_random else None
    out = func(*args, **kwargs)
    region._record(func, info, h_args, h_kwargs, inputs, out, rng, args, kwargs, overwritten)
    return out
