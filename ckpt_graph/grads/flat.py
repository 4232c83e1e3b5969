"""Flat gradient buffers: every parameter's ``.grad`` is a view of one contiguous buffer.

One buffer per (device, dtype) holds the gradients of all parameters: one all-reduce or one
fused optimizer kernel can cover it, and the ``.grad`` pointers stay fixed across steps, which
CUDA graph capture needs. Gradients computed by ordinary autograd are accumulated into the
buffer in place; a custom ``autograd.Function`` can instead write a gradient straight into its
parameter's slice and have autograd adopt it without a copy (:meth:`FlatGrads.write_grad`).

Example:
    >>> import torch
    >>> from ckpt_graph.grads import FlatGrads
    >>> model = torch.nn.Linear(4, 3)
    >>> flat = FlatGrads(model)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> flat.zero_()
    >>> model(torch.randn(2, 4)).sum().backward()
    >>> opt.step()
    >>> model.weight.grad.data_ptr() == flat.buffer(torch.device("cpu"), torch.float32).data_ptr()
    True
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ckpt_graph._errors import CkptGraphError, CkptGraphTypeError, CkptGraphValueError
from ckpt_graph.grads.layout import ALIGN_BYTES, Slot, SlotState, collect_params, slot_stride

__all__ = ["FlatGrads"]

# Note [Gradient adoption]
# AccumulateGrad (torch/csrc/autograd/functions/accumulate_grad.h) is the autograd node that
# writes a leaf's gradient into `.grad`. For a dense gradient `new` arriving at parameter `p`:
#   1. `p.grad` is None, grad mode is off (not create_graph), `new` is stealable and `new` obeys
#      the layout contract -> `p.grad = new.detach()`: ADOPTION, no copy, `.grad` shares
#      `new`'s storage. Stealable: `new`'s TensorImpl is referenced only by the engine, plus
#      its Python tensor object if nothing else refers to that object, plus one more if the
#      AccumulateGrad node has post hooks (`node.register_hook`; post-*accumulate-grad* hooks
#      on the tensor do not count). Any other reference to the same tensor object (a list,
#      `ctx`, a live local) blocks it; other *views* of the same storage do not, they are
#      separate TensorImpls. Not sparse, not nested. Layout contract: if `p` is
#      non-overlapping and dense, `new` has `p`'s strides in every dimension of size > 1 and
#      no zero stride in dimensions of size 1; otherwise `new` is row-major contiguous.
#   2. `p.grad` is None but any condition of 1 fails -> `p.grad` = a copy of `new` with the
#      contract's layout: one read and one write per element, and a fresh allocation.
#   3. `p.grad` exists, grad mode off -> `p.grad += new` in place: ACCUMULATION, two reads and
#      one write per element; `.grad` keeps its storage.
#   4. `p.grad` exists, grad mode on (create_graph=True) -> `p.grad = p.grad + new` out of
#      place, with history: `.grad` leaves the buffer.
# Consequences for FlatGrads:
#   - Ordinary autograd computes every gradient into a fresh tensor, so with `.grad` attached
#     to the buffer it always takes path 3. `zero_()` (one write per element) plus path 3 costs
#     four memory passes per element on top of the producing kernel.
#   - Zero-copy needs the producing kernel to write into the slice itself: `grad_destination`
#     clears `p.grad` and returns a fresh view of the slice (layout chosen to obey the
#     contract); the backward writes into it with `out=` and returns it; path 1 adopts it.
#     It is handed out only when (a) the slice holds no gradient to keep (no gradient since
#     `zero_()`, or `.grad` was set to None), (b) grad mode is off, (c) the engine will run
#     `p`'s AccumulateGrad in this pass (not `autograd.grad`, not excluded by `inputs=`), and
#     (d) `p` was never asked for twice in one pass. Otherwise the caller computes out of
#     place and path 3 (or 2) applies. Why (d): when `p` is used twice, the engine sums the two
#     gradients before AccumulateGrad, and the sum does not land in the slice (torch 2.13
#     does not add into a view there), so it must be copied back; after the first time, `p`
#     is not handed out again (tested in test_parameter_used_twice_in_one_pass).
#   - Cheapest: `.grad = None` (`optimizer.zero_grad()`) before backward, and every gradient
#     written through `grad_destination`: nothing zeroed, nothing copied, and each `.grad`
#     ends at its fixed slice address; a parameter that gets no gradient keeps `.grad` None
#     (the optimizer skips it, as it would without the buffer).
#   - Whatever path ran, a post-accumulate-grad hook checks that `p.grad` is the buffer view.
#     If not (path 2: a reference kept to the handed-out view; `.grad` was None, e.g. after
#     `optimizer.zero_grad(set_to_none=True)`; the sum of (d)), it copies the gradient into
#     the slice and re-attaches the view, warning once per kind except for (d): correct, at
#     the cost of one extra read and write per element (two after a path-2 copy). Path 4
#     results with history are left alone until `zero_()`.


class FlatGrads:
    """Keeps every parameter's ``.grad`` as a view of one contiguous buffer per (device, dtype).

    Each slice has the parameter's own strides (row-major if the parameter is not dense), so
    autograd accumulates into it in place and can adopt gradients written into it. Slices start
    at 64-byte boundaries; the padding stays zero. Parameters that do not require grad are left
    alone; a parameter listed twice (tied weights) gets one slice. Existing gradients are copied
    into the buffer.

    Args:
        params_or_module: an ``nn.Module`` (its parameters) or an iterable of leaf tensors.
        dtype: if given, every parameter must have this dtype (autograd requires ``.grad`` to
            have its parameter's dtype, so a buffer cannot hold gradients in another dtype).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> flat = FlatGrads(model)
        >>> flat.zero_()
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> buf = flat.buffer(torch.device("cpu"), torch.float32)
        >>> all(v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        ...     for v in flat.views().values())
        True

    Invariants:
        Outside a backward pass every managed parameter's ``.grad`` is None or its buffer view;
        after its gradient arrives in a backward it is its buffer view (unless create_graph).

    Known limitations:
        - A parameter must keep its shape, dtype and device (``model.to()`` after construction
          raises CkptGraphError at the next ``zero_()``); build a new FlatGrads instead.
        - Each parameter carries a post-accumulate-grad hook: one Python call per parameter
          per backward. ``remove()`` takes the hooks off.
        - ``backward(create_graph=True)`` leaves ``.grad`` (which carries history) outside the
          buffer until the next ``zero_()``.
        - Sparse gradients are stored densely in the buffer.
        - Condition (c) of Note [Gradient adoption] uses the private
          ``torch._C._will_engine_execute_node``; without it nothing is handed out (the
          accumulation path, still correct).
        - Untested with DDP/FSDP (which keep their own buckets) and compiled autograd.
    """

    def __init__(
        self,
        params_or_module: nn.Module | Iterable[torch.Tensor],
        dtype: torch.dtype | None = None,
    ) -> None:
        named = collect_params(params_or_module)
        if dtype is not None:
            for name, p in named:
                if p.dtype != dtype:
                    raise CkptGraphTypeError(
                        f"ckpt_graph: FlatGrads: {name} has dtype {p.dtype}, not {dtype}; autograd requires "
                        "a .grad of the parameter's own dtype, so pass only parameters of that "
                        "dtype (e.g. [p for p in model.parameters() if p.dtype == dtype])"
                    )
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        self._slots: list[Slot] = []
        self._by_param: dict[int, Slot] = {}
        for name, p in named:
            key = (p.device, p.dtype)
            align = max(1, ALIGN_BYTES // p.element_size())
            offset = -(-sizes.get(key, 0) // align) * align
            sizes[key] = offset + p.numel()
            slot = Slot(p, name, key, offset, tuple(p.shape), slot_stride(p))
            self._slots.append(slot)
            self._by_param[id(p)] = slot
        self._buffers = {
            key: torch.zeros(n, device=key[0], dtype=key[1]) for key, n in sizes.items()
        }
        self._warned: set[str] = set()
        self_ref = weakref.ref(self)
        for slot in self._slots:
            buf = self._buffers[slot.key]
            slot.ptr = buf.data_ptr() + slot.offset * buf.element_size()
            p = slot.param
            view = self._view(slot)
            if p.grad is not None:
                with torch.no_grad():
                    view.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                slot.state = SlotState.FULL
            p.grad = view
            # Holding the AccumulateGrad node keeps it the one the engine runs for `p`.
            # See Note [Gradient adoption], condition (c).
            with torch.enable_grad():
                slot.acc_node = p.view_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            slot.hook = p.register_post_accumulate_grad_hook(_make_hook(self_ref, slot))

    # -- inspection ------------------------------------------------------------------------

    def buffer(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The flat 1-D buffer holding the gradients of the parameters on ``device``/``dtype``.

        A device without an index (``"cuda"``) matches the only buffer of that device type.

        Example:
            >>> flat.buffer("cpu", torch.float32).shape  # doctest: +SKIP
        """
        dev = torch.device(device)
        found = [
            buf
            for (d, t), buf in self._buffers.items()
            if t == dtype and d.type == dev.type and dev.index in (None, d.index)
        ]
        if len(found) != 1:
            raise CkptGraphValueError(
                f"ckpt_graph: FlatGrads has {len(found) or 'no'} buffers for {dev} / {dtype}; it has "
                f"{[(str(d), t) for d, t in self._buffers]}"
            )
        return found[0]

    def buffers(self) -> dict[tuple[torch.device, torch.dtype], torch.Tensor]:
        """All buffers, keyed by (device, dtype)."""
        return dict(self._buffers)

    def parameters(self) -> list[torch.Tensor]:
        """The managed parameters, in buffer order."""
        return [slot.param for slot in self._slots]

    def views(self) -> dict[torch.Tensor, torch.Tensor]:
        """A fresh view of every parameter's slice, keyed by parameter (identity).

        The views share the buffer's storage whatever ``.grad`` currently is; holding them does
        not prevent adoption (they are separate tensors).
        """
        return {slot.param: self._view(slot) for slot in self._slots}

    @property
    def nbytes(self) -> int:
        """Total bytes of all buffers (padding included)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __repr__(self) -> str:
        parts = ", ".join(f"{d}/{t}: {b.numel()}" for (d, t), b in self._buffers.items())
        return f"FlatGrads({len(self._slots)} parameters; {parts})"

    # -- stepping --------------------------------------------------------------------------

    def zero_(self) -> None:
        """Zeroes every buffer in place and makes every ``.grad`` its buffer view again.

        Pointers do not change, so it can run inside a captured CUDA graph. After it, the first
        gradient of each parameter is accumulated into zeros, or adopted if written with
        :meth:`write_grad`. A ``.grad`` that was set to None or replaced is re-attached here
        (no copy: the slice is zeroed like the others).
        """
        with torch.no_grad():
            for buf in self._buffers.values():
                buf.zero_()
        for slot in self._slots:
            p = slot.param
            if (p.device, p.dtype, tuple(p.shape), slot_stride(p)) != slot.layout:
                dev, dt, shape, stride = slot.layout
                raise CkptGraphError(
                    f"ckpt_graph: FlatGrads: {slot.name} is now {p.device}/{p.dtype} with shape "
                    f"{tuple(p.shape)} and strides {tuple(p.stride())}, but its buffer slice was "
                    f"built for {dev}/{dt} shape {shape} strides {stride}; build a new FlatGrads "
                    "after moving, converting or resizing the model"
                )
            if not self._is_attached(slot, p.grad):
                p.grad = self._view(slot)
            slot.state = SlotState.EMPTY

    def remove(self) -> None:
        """Removes the hooks; ``.grad`` views stay valid but are no longer kept in the buffer."""
        for slot in self._slots:
            if slot.hook is not None:
                slot.hook.remove()
                slot.hook = None

    # -- zero-copy writes ------------------------------------------------------------------

    def grad_destination(self, param: torch.Tensor) -> torch.Tensor | None:
        """A tensor for a custom Function's backward to write ``param``'s gradient into.

        Returns a fresh view of ``param``'s slice and clears ``param.grad`` when autograd will
        adopt the result without a copy; otherwise None, and the caller computes out of place
        (autograd then adds it into ``.grad``: two reads and one write per element). The
        caller must overwrite the whole view (e.g. ``torch.mm(a, b, out=dst)``), return it as
        the gradient, and keep no other reference to it. See Note [Gradient adoption].

        Example:
            >>> dst = flat.grad_destination(weight)  # doctest: +SKIP
            >>> grad_w = torch.mm(g.t(), x, out=dst) if dst is not None else g.t() @ x  # doctest: +SKIP
        """
        slot = self._slot(param)
        if slot.state is SlotState.HANDED:
            slot.shared = True
            return None
        if slot.shared or torch.is_grad_enabled():
            return None
        grad = param.grad
        if grad is not None and not (
            slot.state is SlotState.EMPTY and self._is_attached(slot, grad)
        ):
            return None
        will_execute = getattr(torch._C, "_will_engine_execute_node", None)
        try:
            will_run = will_execute is not None and will_execute(slot.acc_node)
        except RuntimeError:  # outside backward, or inside autograd.grad
            return None
        if not will_run:
            return None
        slot.state = SlotState.HANDED
        param.grad = None
        return self._view(slot)

    def write_grad(
        self, param: torch.Tensor, compute: Callable[[torch.Tensor | None], torch.Tensor]
    ) -> torch.Tensor:
        """Computes ``param``'s gradient with ``compute(out)``, into its slice when possible.

        ``compute`` receives the destination from :meth:`grad_destination` (or None) and must
        return the gradient; ops taking ``out=None`` make this a one-liner.

        Example:
            >>> grad_w = flat.write_grad(weight, lambda out: torch.mm(g.t(), x, out=out))  # doctest: +SKIP
        """
        return compute(self.grad_destination(param))

    # -- internals ---------------------------------------------------------------------------

    def _slot(self, param: torch.Tensor) -> Slot:
        slot = self._by_param.get(id(param))
        if slot is None or slot.param is not param:
            raise CkptGraphValueError(
                f"ckpt_graph: FlatGrads does not manage this tensor (shape {tuple(param.shape)}); pass it "
                "to FlatGrads(...) first"
            )
        return slot

    def _view(self, slot: Slot) -> torch.Tensor:
        return self._buffers[slot.key].as_strided(slot.shape, slot.stride, slot.offset)

    def _is_attached(self, slot: Slot, grad: torch.Tensor | None) -> bool:
        if grad is None or grad.layout != torch.strided:
            return False
        if grad.numel() == 0:
            return True
        return grad.data_ptr() == slot.ptr and tuple(grad.stride()) == slot.stride

    def _after_accumulate(self, slot: Slot) -> None:
        p = slot.param
        grad = p.grad
        state, slot.state = slot.state, SlotState.FULL
        if grad is None or self._is_attached(slot, grad) or grad.requires_grad:
            return
        view = self._view(slot)
        with torch.no_grad():
            view.copy_(grad.to_dense() if grad.is_sparse else grad)
        p.grad = view
        if state is SlotState.HANDED and not slot.shared:
            self._warn_once(
                "handed",
                f"ckpt_graph: FlatGrads: the gradient of {slot.name} was written into its "
                "buffer slice but autograd copied it instead of adopting it (something kept a "
                "reference to the returned tensor, or its layout did not match); it was "
                "copied into the buffer: two extra reads and two extra writes per element. See "
                "Note [Gradient adoption] in ckpt_graph/grads/flat.py",
            )
        elif state is not SlotState.HANDED and not torch.is_grad_enabled():  # not create_graph
            self._warn_once(
                "detached",
                f"ckpt_graph: FlatGrads: {slot.name}.grad was not its buffer view after its "
                "gradient arrived (.grad was None, e.g. after optimizer.zero_grad() with its "
                "default set_to_none=True, or was replaced); the gradient was allocated fresh "
                "and copied into the buffer: one extra read and write per element, and .grad "
                "pointers are not stable during backward. Call flat.zero_() instead, or "
                "optimizer.zero_grad(set_to_none=False)",
            )

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, UserWarning, stacklevel=2)


def _make_hook(
    flat_ref: weakref.ReferenceType[FlatGrads], slot: Slot
) -> Callable[[torch.Tensor], None]:
    # A weak reference, so parameters do not keep their FlatGrads (and its buffers) alive.
    def hook(_param: torch.Tensor) -> None:
        flat = flat_ref()
        if flat is not None:
            flat._after_accumulate(slot)

    return hook
