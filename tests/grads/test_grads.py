"""Tests for ckpt_graph.grads: flat gradient buffers, adoption vs accumulation."""

from __future__ import annotations

import copy
import gc
import itertools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ckpt_graph
from ckpt_graph._errors import CkptGraphError
from ckpt_graph.grads import FlatGrads, linear

CPU = torch.device("cpu")
needs_core = pytest.mark.skipif(
    not hasattr(ckpt_graph, "save_recompute_policy"),
    reason="ckpt_graph core (save_recompute_policy/checkpoint) not available yet",
)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _attached(flat: FlatGrads, p: torch.Tensor) -> bool:
    """p.grad is p's slice of the flat buffer, with the slice's strides."""
    view = flat.views()[p]  # type: ignore[index]
    g = p.grad
    return (
        g is not None
        and _storage(g) == _storage(view)
        and g.data_ptr() == view.data_ptr()
        and g.stride() == view.stride()
    )


class _BufferOps(TorchDispatchMode):
    """Records the aten ops that touch a given storage."""

    def __init__(self, storage_ptr: int) -> None:
        super().__init__()
        self.ptr = storage_ptr
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for a in tree_flatten((args, kwargs))[0]:
            if (
                isinstance(a, torch.Tensor)
                and a.layout == torch.strided
                and a.untyped_storage().data_ptr() == self.ptr
            ):
                self.ops.append(func.overloadpacket.__name__)
                break
        return func(*args, **kwargs)


def _mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    ).to(dtype)


class _FlatMLP(nn.Module):
    """The same MLP, with its Linear layers run through ckpt_graph.grads.linear."""

    def __init__(self, seq: nn.Sequential, flat: FlatGrads | None) -> None:
        super().__init__()
        self.seq = seq
        self.flat = flat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.seq:
            x = linear(x, m.weight, m.bias, flat=self.flat) if isinstance(m, nn.Linear) else m(x)
        return x


# -- layout -------------------------------------------------------------------------------------


def test_views_are_slices_of_one_buffer_with_param_strides() -> None:
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    dense_t = nn.Parameter(torch.randn(5, 3).t())  # dense, not contiguous
    strided = nn.Parameter(torch.randn(4, 6)[:, ::2])  # not dense -> row-major slice
    params = [conv.weight, conv.bias, dense_t, strided, dense_t]  # dense_t twice: one slice
    flat = FlatGrads(params)
    buf = flat.buffer("cpu", torch.float32)
    assert len(flat.parameters()) == 4
    spans = []
    for p in flat.parameters():
        g = p.grad
        assert g is not None and _storage(g) == _storage(buf)
        assert (g.data_ptr() - buf.data_ptr()) % 64 == 0
        start = (g.data_ptr() - buf.data_ptr()) // 4
        spans.append((start, start + p.numel()))
    assert conv.weight.grad.stride() == conv.weight.stride()
    assert dense_t.grad.stride() == dense_t.stride() == (1, 3)
    assert strided.grad.stride() == (3, 1) and strided.stride() == (6, 2)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] <= buf.numel()
    assert not buf.any()


def test_one_buffer_per_dtype_and_dtype_check() -> None:
    a = nn.Parameter(torch.randn(3))
    b = nn.Parameter(torch.randn(2, dtype=torch.float64))
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    flat = FlatGrads([a, b, frozen])
    assert set(flat.buffers()) == {(CPU, torch.float32), (CPU, torch.float64)}
    assert frozen.grad is None and flat.parameters() == [a, b]
    with pytest.raises(TypeError, match=r"parameter 1 has dtype torch.float64, not torch.float32"):
        FlatGrads([a, b], dtype=torch.float32)
    assert flat.buffer(CPU, torch.float64) is flat.buffer("cpu", torch.float64)
    with pytest.raises(ValueError, match=r"has no buffers for cpu / torch\.float16"):
        flat.buffer("cpu", torch.float16)
    with pytest.raises(TypeError, match="got a single tensor"):
        FlatGrads(a)
    with pytest.raises(ValueError, match="does not manage this tensor"):
        flat.grad_destination(frozen)


def test_existing_grads_are_copied_in() -> None:
    p = nn.Parameter(torch.randn(3, 2))
    p.grad = torch.arange(6.0).reshape(3, 2)
    flat = FlatGrads([p])
    assert _attached(flat, p)
    torch.testing.assert_close(p.grad, torch.arange(6.0).reshape(3, 2), rtol=0, atol=0)
    (p * 2).sum().backward()
    torch.testing.assert_close(p.grad, torch.arange(6.0).reshape(3, 2) + 2, rtol=0, atol=0)


def test_zero_keeps_pointers() -> None:
    model = _mlp()
    flat = FlatGrads(model)
    before = [p.grad.data_ptr() for p in model.parameters()]
    model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    assert flat.buffer("cpu", torch.float64).abs().sum() > 0
    flat.zero_()
    assert [p.grad.data_ptr() for p in model.parameters()] == before
    assert not flat.buffer("cpu", torch.float64).any()


# -- accumulation vs adoption -------------------------------------------------------------------


def test_ordinary_autograd_accumulates_in_place() -> None:
    ref, model = _mlp(), _mlp()
    flat = FlatGrads(model)
    x = torch.randn(5, 6, dtype=torch.float64)
    ref(x).sum().backward()
    flat.zero_()
    rec = _BufferOps(_storage(flat.buffer("cpu", torch.float64)))
    with rec:
        model(x).sum().backward()
    assert rec.ops.count("add_") == len(flat.parameters())  # path 3: one += per parameter
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert _attached(flat, p)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_write_grad_is_adopted_without_copy() -> None:
    seq_ref, seq = _mlp(), _mlp()
    flat = FlatGrads(seq)
    x = torch.randn(5, 6, dtype=torch.float64)
    _FlatMLP(seq_ref, None)(x).sum().backward()
    flat.zero_()
    rec = _BufferOps(_storage(flat.buffer("cpu", torch.float64)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with rec:
            _FlatMLP(seq, flat)(x).sum().backward()
    assert "add_" not in rec.ops and "copy_" not in rec.ops
    assert rec.ops.count("mm") == 3 and rec.ops.count("sum") == 3  # written with out=
    for p, q in zip(seq.parameters(), seq_ref.parameters(), strict=True):
        assert _attached(flat, p)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    torch.testing.assert_close(
        seq[0].weight.grad, _reference_linear_grad(seq_ref, x), rtol=1e-12, atol=1e-12
    )


def _reference_linear_grad(seq: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    plain = copy.deepcopy(seq)
    plain.zero_grad(set_to_none=True)
    plain(x).sum().backward()
    assert plain[0].weight.grad is not None
    return plain[0].weight.grad


class _Scale3(torch.autograd.Function):
    """y = 3 * w, with w's gradient written by FlatGrads.write_grad; may keep a reference."""

    kept: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, flat: FlatGrads, keep: bool) -> torch.Tensor:
        ctx.w, ctx.flat, ctx.keep = w, flat, keep
        return w * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        gw = ctx.flat.write_grad(ctx.w, lambda out: torch.mul(g, 3, out=out))
        if ctx.keep:
            _Scale3.kept.append(gw)  # a second reference: autograd must copy, not adopt
        return gw, None, None


@pytest.mark.parametrize("keep", [False, True])
def test_reference_kept_blocks_adoption_and_is_repaired(keep: bool) -> None:
    w = nn.Parameter(torch.randn(4))
    flat = FlatGrads([w])
    flat.zero_()
    buf = flat.buffer("cpu", torch.float32)
    rec = _BufferOps(_storage(buf))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec:
            (_Scale3.apply(w, flat, keep) * torch.arange(4.0)).sum().backward()
    messages = [str(c.message) for c in caught]
    if keep:
        kept = _Scale3.kept.pop()
        assert _storage(kept) == _storage(buf)
        assert any("autograd copied it instead of adopting it" in m for m in messages)
        assert "copy_" in rec.ops  # path 2 clone, then copied back into the slice
    else:
        assert not messages and "copy_" not in rec.ops and "add_" not in rec.ops
    assert _attached(flat, w)
    torch.testing.assert_close(w.grad, 3 * torch.arange(4.0), rtol=0, atol=0)


def test_parameter_used_twice_in_one_pass() -> None:
    seq_ref, seq = _mlp(), _mlp()
    flat = FlatGrads(seq)
    x = torch.randn(3, 8, dtype=torch.float64)
    # seq[2] (8 -> 8) applied twice: the second write of the pass is computed out of place.
    w_ref, b_ref, w, b = seq_ref[2].weight, seq_ref[2].bias, seq[2].weight, seq[2].bias
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the sum lands outside the slice: expected, no warning
        for _ in range(2):  # from the second pass on the slice is not handed out at all
            linear(linear(x, w_ref, b_ref).tanh(), w_ref, b_ref).sum().backward()
            flat.zero_()
            rec = _BufferOps(_storage(flat.buffer("cpu", torch.float64)))
            with rec:
                linear(linear(x, w, b, flat=flat).tanh(), w, b, flat=flat).sum().backward()
            assert _attached(flat, w) and _attached(flat, b)
            torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=0)
            torch.testing.assert_close(b.grad, b_ref.grad, rtol=0, atol=0)
            w_ref.grad = b_ref.grad = None
    assert rec.ops.count("add_") == 2 and "copy_" not in rec.ops


@pytest.mark.parametrize("flat_linear", [False, True])
def test_micro_batch_accumulation(flat_linear: bool) -> None:
    seq_ref, seq = _mlp(), _mlp()
    flat = FlatGrads(seq)
    xs = torch.randn(4, 3, 6, dtype=torch.float64).unbind(0)
    run_ref = _FlatMLP(seq_ref, None) if flat_linear else seq_ref
    run = _FlatMLP(seq, flat) if flat_linear else seq
    for x in xs:
        run_ref(x).pow(2).sum().backward()
    ptrs = [p.grad.data_ptr() for p in seq.parameters()]
    flat.zero_()
    rec = _BufferOps(_storage(flat.buffer("cpu", torch.float64)))
    with rec:
        for x in xs:
            run(x).pow(2).sum().backward()
    # flat linear: adoption for the first micro-batch, += for the other three
    n = len(flat.parameters())
    assert rec.ops.count("add_") == (3 * n if flat_linear else 4 * n)
    assert [p.grad.data_ptr() for p in seq.parameters()] == ptrs
    for p, q in zip(seq.parameters(), seq_ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_no_destination_outside_an_accumulating_backward() -> None:
    seq = _mlp()
    flat = FlatGrads(seq)
    flat.zero_()
    w = seq[0].weight
    assert flat.grad_destination(w) is None  # not in backward
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    run = _FlatMLP(seq, flat)
    # autograd.grad: no AccumulateGrad runs; the result must not alias the buffer
    (gw,) = torch.autograd.grad(run(x).sum(), [w])
    assert _storage(gw) != _storage(flat.buffer("cpu", torch.float64))
    assert _attached(flat, w) and not w.grad.any()
    # inputs= excluding the weight
    run(x).sum().backward(inputs=[x])
    assert _attached(flat, w) and not w.grad.any()
    # create_graph: grad mode is on in backward; autograd adds out of place, with history
    run(x).sum().backward(create_graph=True)
    assert w.grad is not None and w.grad.requires_grad and not _attached(flat, w)
    torch.testing.assert_close(w.grad, gw, rtol=0, atol=0)
    flat.zero_()
    assert _attached(flat, w) and not w.grad.any()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_grad_with_history_stays_until_zero() -> None:
    w = nn.Parameter(torch.randn(3, dtype=torch.float64))
    flat = FlatGrads([w])
    w.grad = None
    (w**3).sum().backward(create_graph=True)
    assert w.grad is not None and w.grad.requires_grad and not _attached(flat, w)
    torch.testing.assert_close(w.grad, 3 * w.detach() ** 2, rtol=0, atol=0)
    flat.zero_()
    assert _attached(flat, w) and not w.grad.any()


def test_set_to_none_reattaches_with_warning() -> None:
    ref, model = _mlp(), _mlp()
    flat = FlatGrads(model)
    x = torch.randn(5, 6, dtype=torch.float64)
    ref(x).sum().backward()
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match=r"set_to_none=True.*copied into the buffer"):
        model(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert _attached(flat, p)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    # with .grad None the slice holds nothing to keep, so write_grad is adopted
    model.zero_grad(set_to_none=True)
    rec = _BufferOps(_storage(flat.buffer("cpu", torch.float64)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with rec:
            _FlatMLP(model, flat)(x).sum().backward()
    assert "add_" not in rec.ops and "copy_" not in rec.ops
    assert all(_attached(flat, p) for p in model.parameters())


def test_sparse_gradients_are_stored_densely() -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    flat = FlatGrads(emb)
    idx = torch.tensor([1, 2, 1])
    emb(idx).sum().backward()  # dense .grad += sparse, in place
    assert _attached(flat, emb.weight)
    emb.weight.grad = None
    with pytest.warns(UserWarning, match="copied into the buffer"):
        emb(idx).sum().backward()
    assert _attached(flat, emb.weight)
    expected = torch.zeros(10, 3)
    expected[1], expected[2] = 2.0, 1.0
    torch.testing.assert_close(emb.weight.grad, expected, rtol=0, atol=0)


def test_model_conversion_is_detected() -> None:
    model = nn.Linear(3, 2)
    flat = FlatGrads(model)
    model.double()
    with pytest.raises(
        CkptGraphError, match=r"ckpt_graph: FlatGrads: weight is now cpu/torch.float64"
    ):
        flat.zero_()


def test_no_reference_cycles_and_remove() -> None:
    model = _mlp()
    flat = FlatGrads(model)
    ref = weakref.ref(flat)
    gc.disable()
    try:
        del flat
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dead hooks are inert: nothing copied, no warning
        model(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    flat = FlatGrads(model)
    flat.remove()
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    assert not _attached(flat, model[0].weight)


# -- optimizers ---------------------------------------------------------------------------------

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("flat_linear", [False, True])
def test_training_matches_without_buffer_bitwise(name: str, flat_linear: bool) -> None:
    ref, model = _mlp(torch.float32), _mlp(torch.float32)
    flat = FlatGrads(model)
    opt_ref, opt = OPTIMIZERS[name](ref.parameters()), OPTIMIZERS[name](model.parameters())
    run_ref = _FlatMLP(ref, None) if flat_linear else ref
    run = _FlatMLP(model, flat) if flat_linear else model
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    torch.manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        opt_ref.zero_grad()
        nn.functional.mse_loss(run_ref(x), y).backward()
        opt_ref.step()
        flat.zero_()
        nn.functional.mse_loss(run(x), y).backward()
        opt.step()
        assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


# -- checkpoint regions -------------------------------------------------------------------------


@needs_core
@pytest.mark.parametrize("how", ["region", "checkpoint", "region_flat_linear"])
def test_checkpointed_gradients_land_in_buffer(how: str) -> None:
    ref, model = _mlp(), _mlp()
    flat = FlatGrads(model)
    xs = torch.randn(2, 4, 6, dtype=torch.float64).unbind(0)
    run_ref = _FlatMLP(ref, None) if how == "region_flat_linear" else ref
    run = _FlatMLP(model, flat) if how == "region_flat_linear" else model
    for x in xs:
        run_ref(x).pow(2).sum().backward()
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    flat.zero_()
    rec = _BufferOps(_storage(flat.buffer("cpu", torch.float64)))
    for x in xs:  # two micro-batches, each in its own region
        if how == "checkpoint":
            y = ckpt_graph.checkpoint(run, x, policy="recompute_all")
        else:
            with ckpt_graph.save_recompute_policy(policy="recompute_all"):
                y = run(x)
        with rec:
            y.pow(2).sum().backward()
    n = len(flat.parameters())  # flat linear: first micro-batch adopted, second accumulated
    assert rec.ops.count("add_") == (n if how == "region_flat_linear" else 2 * n)
    assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert _attached(flat, p)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


# -- CUDA graphs --------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_of_a_full_step() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    flat = FlatGrads(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    static_x = torch.randn(8, 16, device=dev)
    static_y = torch.randn(8, 4, device=dev)
    slots = {p: v.data_ptr() for p, v in flat.views().items()}
    buf = flat.buffer("cuda", torch.float32)  # no index: the only CUDA buffer

    def step() -> None:
        flat.zero_()
        nn.functional.mse_loss(model(static_x), static_y).backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up on a side stream, as capture requires
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert all(p.grad is not None and p.grad.data_ptr() == ptr for p, ptr in slots.items())
    # eager twin, starting from the state after capture (capture runs no kernels)
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # else momentum buffers alias
    for i in range(3):
        static_x.copy_(torch.randn(8, 16, device=dev))
        static_y.copy_(torch.randn(8, 4, device=dev))
        graph.replay()
        opt_ref.zero_grad()
        nn.functional.mse_loss(ref(static_x), static_y).backward()
        opt_ref.step()
        torch.cuda.synchronize()
        assert all(p.grad is not None and p.grad.data_ptr() == ptr for p, ptr in slots.items()), i
        assert all(_storage(p.grad) == _storage(buf) for p in slots), i
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
            torch.testing.assert_close(p, q)
