"""Defects found by PyTorch's own checkpoint tests and an adversarial suite (issue 14).

Every test compares gradients bitwise with a run without checkpointing, or matches the
error by message. Each one failed before its fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg
from ckpt_graph import policies
from ckpt_graph._errors import CkptGraphError


def _grads(
    fn: Callable[[], torch.Tensor], params: list[torch.Tensor], seed: int = 0
) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    fn().backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    return grads


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ------------------------------------------------------------ item 5: out= and policies


def _answer_none(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _keep_out_kwarg(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    # The op's out= tensor arrives as out_ (see Note [Policy keyword arguments]); the op's
    # result is the positional ``out``, which aliases it.
    return "out_" in kwargs and kwargs["out_"] is out


def _sac_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # torch's SAC convention: the out= tensor under its own name.
    assert "out_" not in kwargs
    if op is torch.ops.aten.mv.out:
        assert isinstance(kwargs["out"], torch.Tensor)
    return CheckpointPolicy.PREFER_RECOMPUTE


SPECTRAL_POLICIES: list[Any] = [
    "recompute_all",
    "must_save_all",
    _answer_none,
    _keep_out_kwarg,
    lambda ctx, out, op, *args, **kwargs: False,
    policies.save_matmuls(),
    policies.from_torch_sac(_sac_mm),
    policies.memory_budget(0.5),
]


@pytest.mark.filterwarnings("ignore:ckpt_graph. memory_budget")
@pytest.mark.parametrize("policy", SPECTRAL_POLICIES)
def test_spectral_norm_out_kwarg_reaches_policies(policy: Any) -> None:
    torch.manual_seed(0)
    lin = nn.utils.spectral_norm(nn.Linear(6, 5))
    x = torch.randn(3, 6, requires_grad=True)
    params = [x, *lin.parameters()]
    u0 = lin.weight_u.clone()

    def step(region: bool) -> torch.Tensor:
        lin.weight_u.copy_(u0)  # the power iteration writes u and v with out=
        if not region:
            return lin(x).tanh().sum()
        with cg.save_recompute_policy(policy):
            return lin(x).tanh().sum()

    want = _grads(lambda: step(False), params)
    u_want = lin.weight_u.clone()
    _assert_same(_grads(lambda: step(True), params), want)
    torch.testing.assert_close(lin.weight_u, u_want, rtol=0, atol=0)


def test_policy_sees_out_kwarg_renamed() -> None:
    seen: list[tuple[Any, dict[str, Any]]] = []

    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        seen.append((op, kwargs))

    a, v, u = torch.randn(3, 4), torch.randn(4), torch.empty(3)
    with cg.save_recompute_policy(policy):
        torch.mv(a, v, out=u)
    (_, kwargs), *_ = [s for s in seen if s[0] is torch.ops.aten.mv.out]
    assert set(kwargs) == {"out_"} and kwargs["out_"] is u


def test_only_out_collides_with_policy_parameters() -> None:
    # Note [Policy keyword arguments] says only ``out`` among aten keyword-only arguments.
    from ckpt_graph.engine.decisions import PROTOCOL_NAMES

    names = {
        a.name
        for s in torch._C._jit_get_all_schemas()
        for a in s.arguments
        if a.kwarg_only and a.name in PROTOCOL_NAMES
    }
    assert names == {"out"}


# ------------------------------------------------------------ item 19: random ops kept by the engine


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_random_op_without_replay_is_kept_whatever_the_tag(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulate a device whose generator the engine cannot replay.
    import ckpt_graph.engine.record

    monkeypatch.setattr(ckpt_graph.engine.record, "capture_rng", lambda args, kwargs: None)
    x = torch.randn(6, requires_grad=True)

    def fwd() -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.bernoulli(torch.full_like(x, 0.5))
        return (x * r).sin().sum(), r

    torch.manual_seed(0)
    y, r_want = fwd()
    y.backward()
    want = [x.grad.clone()]
    x.grad = None
    torch.manual_seed(0)
    with cg.save_recompute_policy(policy) as region:
        y, r = fwd()
        cg.tag_with_policy(r, False)
    torch.testing.assert_close(r, r_want, rtol=0, atol=0)
    (h,) = [n.outputs[0] for n in region.nodes if n.info.name == "aten.bernoulli.default"]
    assert h is not None and h.reason == "engine: random op on a device without generator replay"
    torch.manual_seed(1)  # a recompute would now draw other values
    y.backward()
    _assert_same([x.grad], want)


# ------------------------------------------------------------ item 8: a failed in-place op


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all", policies.save_matmuls()])
@pytest.mark.parametrize("first_write", [True, False])
def test_failed_inplace_op_changes_nothing(policy: Any, first_write: bool) -> None:
    x = torch.randn(4, 4, requires_grad=True)

    def fwd() -> torch.Tensor:
        y = x * 2
        # with a write before, the storage index exists before the failing write
        w = x + 0 if first_write else (x + 1).mul_(2)
        z = (y @ y).sin()  # saves y
        with pytest.raises(RuntimeError, match="must match the size"):
            y[0:2].add_(torch.ones(3))
        with pytest.raises(RuntimeError, match="must match the size"):
            y.mul_(torch.ones(3))
        return (z * w).sum() + y.tanh().sum()

    want = _grads(fwd, [x])
    with cg.save_recompute_policy(policy):
        got = _grads(fwd, [x])
    _assert_same(got, want)


@pytest.mark.parametrize("policy", ["recompute_all", policies.save_matmuls()])
def test_failed_inplace_op_keeps_saved_temporary_views_valid(policy: Any) -> None:
    # The undo restored the base's `superseded` flag but not its count of writes, which a
    # saved temporary view is checked against: backward raised a version error.
    x = torch.randn(4, 3, requires_grad=True)

    def fwd() -> torch.Tensor:
        y = x * 2
        z = y[1].sin()  # saves the temporary view y[1]
        with pytest.raises(RuntimeError, match="must match the size"):
            y[0:2].add_(torch.ones(5))
        return z.sum() + y.sum()

    want = _grads(fwd, [x])
    with cg.save_recompute_policy(policy):
        got = _grads(fwd, [x])
    _assert_same(got, want)


def test_failed_inplace_op_then_real_write_still_raises() -> None:
    # After the undo, a successful write of the saved value still raises as eager does.
    x = torch.randn(4, requires_grad=True)
    with cg.save_recompute_policy("must_save_all"):
        y = x * 2
        z = y.sin()  # saves y
        with pytest.raises(RuntimeError, match="must match the size"):
            y[0:2].add_(torch.ones(3))
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


# ------------------------------------------------------------ item 10: reading a saved tensor twice


class _ReadTwice(torch.autograd.Function):
    """``a * b`` whose backward reads ``ctx.saved_tensors`` twice."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, _ = ctx.saved_tensors
        _, b = ctx.saved_tensors
        a2, b2 = ctx.saved_tensors
        assert torch.equal(b, b2)
        return g * b2 * (a2 is not None), g * a


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all", policies.save_matmuls()])
@pytest.mark.parametrize("retain", [False, True])
def test_custom_function_reads_saved_tensors_twice(policy: Any, retain: bool) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def fwd() -> torch.Tensor:
        h = (x @ w).sin()
        d = torch.nn.functional.dropout(h, 0.5) + 1
        return (_ReadTwice.apply(h.exp(), d) @ w).tanh().sum()

    want = _grads(fwd, [x, w])
    torch.manual_seed(0)
    with cg.save_recompute_policy(policy):
        y = fwd()
    y.backward(retain_graph=retain)
    got = [x.grad.clone(), w.grad.clone()]
    _assert_same(got, want)
    if retain:  # a second pass reads twice again
        x.grad = w.grad = None
        y.backward()
        _assert_same([x.grad, w.grad], want)


def test_hook_reads_saved_self_before_the_node_runs() -> None:
    x = torch.randn(5, requires_grad=True)
    seen: list[torch.Tensor] = []

    def fwd() -> torch.Tensor:
        y = x.sin()
        z = y * x.cos()
        grad_fn = z.grad_fn
        assert grad_fn is not None
        z.register_hook(lambda g: seen.append(grad_fn._saved_self))  # type: ignore[attr-defined]
        return z.exp().sum()

    want = _grads(fwd, [x])
    with cg.save_recompute_policy("recompute_all"):
        y = fwd()
    y.backward()
    _assert_same([x.grad], want)
    torch.testing.assert_close(seen[-1], x.detach().sin(), rtol=0, atol=0)


def test_value_read_twice_is_freed() -> None:
    import gc
    import weakref

    from models import LIVE_OUTPUTS, counted

    def run_once() -> list[weakref.ref[Any]]:
        x = torch.randn(3, 4, requires_grad=True)
        with cg.save_recompute_policy("recompute_all"):
            h = counted(x * 2)
            refs = [weakref.ref(h), weakref.ref(h.untyped_storage())]
            y = _ReadTwice.apply(h, x.cos()).sum()
        del h
        y.backward()
        return refs

    run_once()  # the first run finishes lazy imports (see tests/engine/test_lifetime.py)
    gc.collect()
    LIVE_OUTPUTS.clear()
    gc.disable()
    try:
        refs = run_once()
        assert not [r for r in refs if r() is not None], "forward value alive"
        # forward, first read; the two further reads recompute (nothing held between reads)
        assert len(LIVE_OUTPUTS) == 4
        assert not [r for r in LIVE_OUTPUTS if r() is not None], "recomputed value alive"
    finally:
        gc.enable()


# ------------------------------------------------------------ item 11: region inputs keep identity


class _MaskedLinear(torch.autograd.Function):
    """``(a @ w) * m``; backward checks which saved tensors are the original objects."""

    identity: ClassVar[list[tuple[bool, bool]]] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, w, m)
        ctx.w, ctx.m = w, m  # the objects, for the identity check in backward
        return (a @ w) * m

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        a, w, m = ctx.saved_tensors
        _MaskedLinear.identity.append((w is ctx.w, m is ctx.m))
        gm = g * m
        return gm @ w.t(), a.t() @ gm, None


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_saved_region_input_is_the_original_object(policy: str) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    mask = torch.bernoulli(torch.full((4,), 0.5))

    def fwd() -> torch.Tensor:
        return _MaskedLinear.apply(x.sin(), w, mask).sum()

    _MaskedLinear.identity.clear()
    want = _grads(fwd, [x, w])
    with cg.save_recompute_policy(policy):
        y = fwd()
    y.backward()
    _assert_same([x.grad, w.grad], want)
    (_, eager_mask), (_, region_mask) = _MaskedLinear.identity
    assert eager_mask and region_mask


class _MainGradLinear(torch.autograd.Function):
    """Megatron's pattern: backward accumulates the weight gradient into ``main_grad``."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, w)
        return a @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        a, w = ctx.saved_tensors
        w.main_grad.add_(a.t() @ g)
        return g @ w.t(), None


@pytest.mark.xfail(
    strict=True,
    reason="issue 14 item 11: autograd re-wraps what an unpack hook returns for a tensor that "
    "requires grad, so a saved parameter loses its identity and main_grad (torch's "
    "non-reentrant checkpoint too); see Note [Region inputs keep their identity]",
)
def test_saved_parameter_keeps_identity_for_main_grad() -> None:
    w = nn.Parameter(torch.randn(3, 4))
    w.main_grad = torch.zeros(3, 4)  # type: ignore[attr-defined]
    x = torch.randn(2, 3, requires_grad=True)
    with cg.save_recompute_policy("recompute_all"):
        y = _MainGradLinear.apply(x.sin(), w).sum()
    y.backward()
    torch.testing.assert_close(w.main_grad, x.detach().sin().t() @ torch.ones(2, 4))  # type: ignore[attr-defined]


def _check_random_backward(
    fwd: Callable[[], torch.Tensor], params: list[torch.Tensor], policy: Any, retain: bool
) -> None:
    """Gradients of a random ``fwd`` under ``policy`` equal eager's, from a generator seeded
    as eager's was, also in a second backward (``retain``)."""
    want = _grads(fwd, params, seed=3)
    torch.manual_seed(3)
    with cg.save_recompute_policy(policy):
        y = fwd()
    torch.manual_seed(4)  # replay must not depend on the stream's position
    y.backward(retain_graph=retain)
    _assert_same([p.grad for p in params], want)  # type: ignore[misc]
    if retain:
        for p in params:
            p.grad = None
        y.backward()
        _assert_same([p.grad for p in params], want)  # type: ignore[misc]


# ------------------------------------------------------------ item 6: RReLU in training mode


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all", policies.save_matmuls()])
@pytest.mark.parametrize("retain", [False, True])
def test_rrelu_training_gradients(policy: Any, retain: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    act = nn.RReLU().train()
    x = torch.randn(4, 8, requires_grad=True)
    params = [x, *lin.parameters()]

    def fwd() -> torch.Tensor:
        h = act(lin(x) * 2)
        return (act(h.sin()) * h).sum()

    _check_random_backward(fwd, params, policy, retain)


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all", policies.save_matmuls()])
@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("act", ["module", "functional"])
def test_inplace_rrelu_training_gradients(policy: Any, retain: bool, act: str) -> None:
    # rrelu_with_noise_ writes self (versioned) and its noise (unversioned): the noise was
    # treated as a versioned write, and backward raised a version error on empty_like's
    # output.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    rrelu: Callable[[torch.Tensor], torch.Tensor] = (
        nn.RReLU(inplace=True).train()
        if act == "module"
        else lambda t: nn.functional.rrelu_(t, training=True)
    )
    x = torch.randn(4, 8, requires_grad=True)
    params = [x, *lin.parameters()]

    def fwd() -> torch.Tensor:
        h = rrelu(lin(x) * 2)
        return (rrelu(h.sin()) * h.cos()).sum()

    _check_random_backward(fwd, params, policy, retain)


def test_rrelu_noise_write_bumps_no_version() -> None:
    # graph._UNVERSIONED_WRITES relies on it: eager's backward reads the noise written by
    # the op through a saved tensor taken before the op (see Note [Silent writes]).
    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    x = torch.randn(8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nn.functional.rrelu(x * 1, training=True)
    assert [t._version for t in seen] == [0, 0]
    assert torch.ops.aten.rrelu_with_noise.default._schema.arguments[1].alias_info.is_write


# ------------------------------------------------------------ item 1: globals at replay


def _factory_forward(x: torch.Tensor) -> torch.Tensor:
    """Every value below comes from a factory op whose dtype follows the default dtype."""
    n = x.shape[0]
    r = torch.rand(n) + torch.randn(n) * torch.full((n,), 1.37)
    r = r + torch.linspace(0.1, 1.3, n) * torch.arange(0.5, n + 0.5)
    r = r + torch.empty(n).fill_(0.3) + torch.zeros(n) + torch.ones(n) * torch.scalar_tensor(0.7)
    r = r + torch.rand_like(x.float()) + torch.ones_like(x.float())  # *_like: from x
    return (x * r.to(x.dtype)).sin().sum()


@pytest.mark.parametrize("policy", ["recompute_all", policies.save_matmuls()])
@pytest.mark.parametrize(
    ("forward_dtype", "backward_dtype"),
    [(torch.float32, torch.float64), (torch.float64, torch.float32)],
)
def test_default_dtype_changed_before_backward(
    policy: Any, forward_dtype: torch.dtype, backward_dtype: torch.dtype
) -> None:
    x = torch.randn(7, dtype=torch.float64, requires_grad=True)
    torch.set_default_dtype(forward_dtype)  # the conftest fixture restores it
    want = _grads(lambda: _factory_forward(x), [x])
    torch.manual_seed(0)
    with cg.save_recompute_policy(policy):
        y = _factory_forward(x)
    torch.set_default_dtype(backward_dtype)
    y.backward()
    _assert_same([x.grad], want)  # type: ignore[list-item]


def _promoting_forward(x: torch.Tensor) -> torch.Tensor:
    """Ops on integers whose floating-point result takes the default dtype."""
    idx = torch.arange(x.shape[0])
    r = idx * 0.1 + idx / 3 + idx.sigmoid() + torch.true_divide(idx, torch.tensor(7))
    return (x * r).sin().sum() + (x * idx.sqrt()).cos().sum()


@pytest.mark.parametrize("policy", ["recompute_all", policies.save_matmuls()])
def test_default_dtype_changed_before_backward_for_integer_promotions(policy: Any) -> None:
    x = torch.randn(7, dtype=torch.float32, requires_grad=True)
    torch.set_default_dtype(torch.float32)  # the conftest fixture restores it
    want = _grads(lambda: _promoting_forward(x), [x])
    with cg.save_recompute_policy(policy):
        y = _promoting_forward(x)
    torch.set_default_dtype(torch.float64)  # idx * 0.1 replayed as float64 values
    y.backward()
    _assert_same([x.grad], want)  # type: ignore[list-item]


def test_default_dtype_changed_inside_region_raises() -> None:
    x = torch.randn(4, requires_grad=True)
    with (
        pytest.raises(CkptGraphError, match=r"torch.set_default_dtype changed inside the region"),
        cg.save_recompute_policy("recompute_all"),
    ):
        y = x.sin()
        torch.set_default_dtype(torch.float64)  # the conftest fixture restores it
        y = y.cos()


def test_default_device_changed_before_backward() -> None:
    x = torch.randn(7, requires_grad=True)
    want = _grads(lambda: _factory_forward(x), [x])
    torch.manual_seed(0)
    with cg.save_recompute_policy("recompute_all"):
        y = _factory_forward(x)
    torch.set_default_device("meta")
    try:
        y.backward()
    finally:
        torch.set_default_device(None)
    _assert_same([x.grad], want)  # type: ignore[list-item]


def test_factory_options_from_the_schema() -> None:
    from ckpt_graph.engine.op_info import op_info

    aten = torch.ops.aten
    for op in (aten.rand.default, aten.full.default, aten.arange.start, aten.empty.memory_format):
        assert set(op_info(op).options) == {"dtype", "layout", "device"}, op
    for op in (aten.rand_like.default, aten.new_zeros.default, aten.sum.dim_IntList):
        assert op_info(op).options == (), op


def _reduction_forward(x: torch.Tensor) -> torch.Tensor:
    s = (x * 1.1).sum()  # chunked per thread on CPU: the last bits depend on the thread count
    return (x * s).sin().sum()


def test_thread_count_changed_before_backward() -> None:
    # The backward's own reductions use the thread count of the backward, in eager too: only
    # the recomputed forward values must follow the forward's.
    x = torch.randn(300_001, requires_grad=True)
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("needs 2 intra-op threads")

    def forward_then_backward(region: bool) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        if region:
            with cg.save_recompute_policy("recompute_all"):
                y = _reduction_forward(x)
        else:
            y = _reduction_forward(x)
        torch.set_num_threads(1)
        y.backward()
        assert torch.get_num_threads() == 1  # restored after the replay
        g = x.grad.clone()  # type: ignore[union-attr]
        x.grad = None
        return [g]

    try:
        torch.set_num_threads(1)
        one = _reduction_forward(x)
        torch.set_num_threads(threads)
        assert not torch.equal(one, _reduction_forward(x))  # the setting matters here
        want = forward_then_backward(False)
        got = forward_then_backward(True)
    finally:
        torch.set_num_threads(threads)
    _assert_same(got, want)


def _matmul_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((x @ w).tanh() @ w).sum()


def _backward_in(context: str, y: torch.Tensor) -> None:
    precision = torch.get_float32_matmul_precision()
    mkldnn = torch.backends.mkldnn.enabled
    try:
        if context == "deterministic":
            torch.use_deterministic_algorithms(True)
            y.backward()
        elif context == "matmul_medium":
            torch.set_float32_matmul_precision("medium")
            y.backward()
        elif context == "no_mkldnn":
            torch.backends.mkldnn.enabled = False
            y.backward()
        elif context == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y.backward()
        else:
            with torch.no_grad():
                y.backward()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision(precision)
        torch.backends.mkldnn.enabled = mkldnn


@pytest.mark.parametrize(
    "context", ["deterministic", "matmul_medium", "no_mkldnn", "autocast", "no_grad"]
)
def test_other_globals_do_not_change_recomputed_values(context: str) -> None:
    # Eager runs its backward under the same setting: the recomputed values must be the
    # forward's, whatever the backward's setting is.
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    _backward_in(context, _matmul_forward(x, w))
    want = [x.grad, w.grad]
    x.grad = w.grad = None
    with cg.save_recompute_policy("recompute_all"):
        y = _matmul_forward(x, w)
    _backward_in(context, y)
    _assert_same([x.grad, w.grad], want)  # type: ignore[list-item]


def test_autocast_forward_backward_outside() -> None:
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    def fwd() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _matmul_forward(x, w).float()

    want = _grads(fwd, [x, w])
    with cg.save_recompute_policy("recompute_all"):
        y = fwd()
    y.backward()
    _assert_same([x.grad, w.grad], want)  # type: ignore[list-item]


def test_setting_changed_inside_region_raises() -> None:
    threads = torch.get_num_threads()
    x = torch.randn(4, requires_grad=True)
    try:
        with (
            pytest.raises(CkptGraphError, match=r"torch.set_num_threads changed inside the region"),
            cg.save_recompute_policy("recompute_all"),
        ):
            y = x.sin()
            torch.set_num_threads(threads + 1)
            y = y.cos()
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------ item 20: tags are per value


def _keep_all(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return True


@pytest.mark.parametrize("tag", [False, True])
def test_tag_on_one_output_leaves_siblings_to_the_policy(tag: bool) -> None:
    x = torch.randn(4, 6, requires_grad=True)

    def fwd(region: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b, c = (x * 2).split(2, dim=1)
        if region:
            cg.tag_with_policy(b, tag)
        return (a.sin() * b.cos() * c.exp()).sum(), a, b

    want = _grads(lambda: fwd(False)[0], [x])
    with cg.save_recompute_policy(_keep_all) as region:
        y, a, b = fwd(True)
    a_why = region.explain(a)
    assert "tag_with_policy" not in a_why.why and a_why.decided_by == "_keep_all"
    b_why = region.explain(b)
    assert (
        "tag_with_policy() on this value asked to " + ("keep" if tag else "recompute") in b_why.why
    )
    assert b_why.decided_by == "tag"
    split = next(n for n in region.nodes if n.info.name == "aten.split.Tensor")
    assert split.decided_by == "_keep_all"
    assert region.tagged == {split.outputs[1]}
    y.backward()
    _assert_same([x.grad], want)  # type: ignore[list-item]


# ------------------------------------------------------------ item 21: bookkeeping


def test_backward_inside_a_policy_leaves_recording_off() -> None:
    # realize restores the flag it found (off during a policy's call), not "region open".
    w = torch.randn(4, 4, requires_grad=True)
    pending: list[torch.Tensor] = []
    seen: list[bool] = []

    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        if op is torch.ops.aten.mm.default and not seen:
            torch.autograd.grad(pending[0], w, retain_graph=True)  # recomputes exp's output
            seen.append(ctx.region.recording.on)
        return False

    with cg.save_recompute_policy(policy):
        pending.append(w.sin().exp().sum())
        (w @ w).sum()
    assert seen == [False]


def test_nested_backward_of_the_same_region_in_a_hook() -> None:
    # A backward inside a backward (a hook) unpacks the region in a second pass: the outer
    # pass's end-of-pass callback must not break it, nor it the outer pass.
    def run(region: bool) -> list[torch.Tensor]:
        torch.manual_seed(1)
        x = torch.randn(6, requires_grad=True)
        inner: list[torch.Tensor] = []

        def fwd() -> tuple[torch.Tensor, torch.Tensor]:
            h = x.sin().exp()
            return (h * 2).tanh(), h.cos().exp().sum()

        if region:
            with cg.save_recompute_policy("recompute_all"):
                a, b = fwd()
        else:
            a, b = fwd()
        a.register_hook(lambda g: inner.append(torch.autograd.grad(b, x, retain_graph=True)[0]))
        a.sum().backward(retain_graph=True)
        first = x.grad.clone()  # type: ignore[union-attr]
        x.grad = None
        b.backward()
        return [first, inner[0], x.grad]  # type: ignore[list-item]

    _assert_same(run(True), run(False))


def test_kept_bytes_count_copies_taken_before_a_write() -> None:
    def fwd(x: torch.Tensor, w: torch.Tensor, region: Any) -> torch.Tensor:
        y = (w * x.exp()).sum()  # x: a region input, kept by reference (0 bytes)
        v = x[::2]
        if region is not None:
            cg.tag_with_policy(v, True)  # a kept view: its bytes are its base's
            assert region.kept_bytes == 0
        z = (w[::2] * v.exp()).sum()
        v.mul_(2)  # recomputing the exps needs the old x and v: both copied first
        if region is not None:  # two new storages of x's size
            assert region.kept_bytes == 2 * x.nbytes
        return y + z

    x0 = torch.randn(1000)
    w = torch.randn(1000, requires_grad=True)
    fwd(x0.clone(), w, None).backward()
    want = [w.grad.clone()]  # type: ignore[union-attr]
    w.grad = None
    x = x0.clone()  # a region input
    with cg.save_recompute_policy("recompute_all") as region:
        y = fwd(x, w, region)
    y.backward()
    _assert_same([w.grad], want)  # type: ignore[list-item]


def test_kept_bytes_count_a_storage_kept_through_a_written_view() -> None:
    w = torch.randn(256, requires_grad=True)
    with cg.save_recompute_policy("must_save_all") as region:
        h = (w * 2).add_(1)  # a kept op output (1 KiB), used below
        t = h * 3
        v = h[:128]
        v.mul_(2)  # h's old value is copied; its storage stays held through v's new version
        held = {
            o.value.untyped_storage().data_ptr(): o.value.untyped_storage().nbytes()
            for n in region.nodes
            for o in n.outputs
            if o is not None and o.value is not None
        }
        assert region.kept_bytes == sum(held.values())
    del t


def test_dead_random_op_drops_its_generator_state() -> None:
    def fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out1 = nn.functional.dropout(x, 0.5).sin().sum()
        out2 = nn.functional.dropout(x, 0.5).cos().sum()
        nn.functional.dropout(x, 0.5).sum()  # nothing saved needs it: dead at exit
        return out1, out2

    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(0)
    out1, out2 = fwd(x)
    (g1,) = torch.autograd.grad(out1, x)
    (g2,) = torch.autograd.grad(out2, x)
    torch.manual_seed(0)
    with cg.save_recompute_policy("recompute_all") as region:
        out1, out2 = fwd(x)
    after = torch.rand(3)  # the user's random stream continues as without the region
    first, second, third = [n for n in region.nodes if n.info.name == "aten.bernoulli_.float"]
    assert third.rng is None
    assert first.rng is not None and second.rng is not None
    torch.testing.assert_close(torch.autograd.grad(out1, x)[0], g1, rtol=0, atol=0)
    assert first.rng is None and second.rng is not None  # the first can no longer run
    torch.testing.assert_close(torch.autograd.grad(out2, x)[0], g2, rtol=0, atol=0)
    assert second.rng is None
    torch.manual_seed(0)
    fwd(x.detach())
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)


def test_kept_random_value_changed_after_the_region_keeps_its_generator_state() -> None:
    # r is kept (tagged) and only read to recompute 2 * r: its op is not needed by any
    # saved tensor, yet writing r after the region makes the region recompute r (Note
    # [Kept values changed after the region]), which needs the generator state.
    def fwd(x: torch.Tensor, tag: bool) -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.rand_like(x)
        if tag:
            cg.tag_with_policy(r, True)
        return r, (x * (2 * r)).sin().sum()

    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(0)
    r, y = fwd(x, False)
    r.add_(1)
    (want,) = torch.autograd.grad(y, x)
    torch.manual_seed(0)
    with cg.save_recompute_policy("recompute_all") as region:
        r, y = fwd(x, True)
    (node,) = [n for n in region.nodes if n.info.is_random]
    assert node.rng is not None
    r.add_(1)
    torch.testing.assert_close(torch.autograd.grad(y, x)[0], want, rtol=0, atol=0)
    assert node.rng is None  # released with r's last use
