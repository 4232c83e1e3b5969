"""``patch_torch_checkpoint``: keywords, threads, backward after the block, real clients.

See Note [Patching torch's checkpoint] and Note [Routing torch's checkpoint calls]. Every
gradient is compared bitwise with plain eager (float64 or deterministic float32 CPU kernels).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from models import RegionSpy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint as checkpoint_bound_at_import
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ckpt_graph as cg
from ckpt_graph.engine.region import Region, current_region
from ckpt_graph.integrations.torch_routing import installed

_G = torch.Generator().manual_seed(0)
_X = torch.randn(4, 8, generator=_G, dtype=torch.float64)
_W = torch.randn(8, 3, generator=_G, dtype=torch.float64)


def _leaves() -> tuple[torch.Tensor, torch.Tensor]:
    return _X.clone().requires_grad_(), _W.clone().requires_grad_()


def _grads(run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    x, w = _leaves()
    run(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None
    return [x.grad, w.grad]


def _inner(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (h.sin() @ w).exp()


def _eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _inner(x.cos(), w).tanh()


def _outer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Code written for torch: a checkpoint call looked up as an attribute."""
    return tc.checkpoint(_inner, x.cos(), w, use_reentrant=False).tanh()


def _same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --- item 5: the function's own `policy=` keyword ----------------------------------------


@pytest.mark.parametrize(
    "value", [2.0, "must_save_all", RegionSpy()], ids=["float", "name", "callable"]
)
def test_policy_keyword_reaches_the_function(value: Any) -> None:
    received: list[Any] = []

    def fn(x: torch.Tensor, w: torch.Tensor, *, policy: Any) -> torch.Tensor:
        received.append(policy)
        return _eager(x, w) * 3.0

    expected = _grads(lambda x, w: _eager(x, w) * 3.0)
    block_policy = RegionSpy()
    with cg.patch_torch_checkpoint(policy=block_policy) as patch:
        got = _grads(lambda x, w: tc.checkpoint(fn, x, w, policy=value, use_reentrant=False))
    assert received == [value]
    assert patch.calls == 1 and len(block_policy.regions) == 1  # the region's policy: the block's
    if isinstance(value, RegionSpy):
        assert value.regions == []
    _same(got, expected)


# --- item 6: blocks in several threads ---------------------------------------------------


def test_blocks_in_two_threads_leave_in_any_order_and_restore() -> None:
    internals = (tc._checkpoint_without_reentrant_generator, tc.CheckpointFunction)
    a, b = cg.patch_torch_checkpoint(RegionSpy()), cg.patch_torch_checkpoint(RegionSpy())
    steps = [threading.Event() for _ in range(4)]
    errors: list[BaseException] = []
    results: dict[str, list[torch.Tensor]] = {}
    expected = _grads(_eager)

    def run(name: str, block: Any, enter: int, leave: int, done: int) -> None:
        try:
            if enter:
                steps[enter - 1].wait(30)
            block.__enter__()
            steps[enter].set()
            steps[leave - 1].wait(30)
            if name == "b":  # after A left: B's block still routes B's calls
                results[name] = _grads(_outer)
            block.__exit__(None, None, None)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            steps[done].set()

    ta = threading.Thread(target=run, args=("a", a, 0, 2, 2))  # A enters, waits for B
    tb = threading.Thread(target=run, args=("b", b, 1, 3, 3))  # B enters, waits for A to leave
    ta.start()
    tb.start()
    ta.join(60)
    tb.join(60)
    assert errors == []
    assert not installed()
    assert (tc._checkpoint_without_reentrant_generator, tc.CheckpointFunction) == internals
    assert (a.calls, b.calls, len(b.policy.regions)) == (0, 1, 1)
    _same(results["b"], expected)


def test_a_thread_follows_its_own_block_else_the_last_entered() -> None:
    mine, other = RegionSpy(), RegionSpy()
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cg.patch_torch_checkpoint(other):
            entered.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert entered.wait(30)
        _grads(_outer)  # this thread entered no block: the one entered last routes it
        assert len(other.regions) == 1
        with cg.patch_torch_checkpoint(mine):
            _grads(_outer)
        assert (len(mine.regions), len(other.regions)) == (1, 1)
    finally:
        release.set()
        t.join(30)
    assert not installed()


# --- item 7: backward after the block, torch checkpoints around the calls -----------------


def test_backward_after_the_block_under_a_torch_checkpoint_bound_before() -> None:
    # The program: the outer torch checkpoint (bound at import) replays `outer` in
    # backward after the block; its inner call must take the path of the forward.
    x, w = _leaves()

    def outer(h: torch.Tensor) -> torch.Tensor:
        return tc.checkpoint(_inner, h.cos(), w, use_reentrant=False).tanh()

    expected = _grads(_eager)
    spy = RegionSpy()
    with cg.patch_torch_checkpoint(spy):
        y = checkpoint_bound_at_import(outer, x, use_reentrant=False)
    y.sum().backward()  # torch replays nothing: both calls ran in regions
    assert len(spy.regions) == 1  # the inner call pushed onto the outer call's region
    _same([x.grad, w.grad], expected)  # type: ignore[list-item]


def test_backward_inside_a_block_replays_a_torch_checkpoint_as_its_forward_ran() -> None:
    expected = _grads(_eager)
    x, w = _leaves()
    y = tc.checkpoint(_outer, x, w, use_reentrant=False)  # torch's, no block: inner is torch's
    with cg.patch_torch_checkpoint() as patch:
        y.sum().backward()  # the replay's inner call must be torch's again
    assert patch.calls == 0
    _same([x.grad, w.grad], expected)  # type: ignore[list-item]


def _middle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return tc.checkpoint(_outer, x.sin(), w, use_reentrant=False).cos()


def _eager_middle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _eager(x.sin(), w).cos()


def test_replay_after_the_block_takes_the_forwards_decisions() -> None:
    # A torch checkpoint that began before the block (frame U) keeps torch's checkpoint for
    # the call made directly in it (frame O, with a warning); O's own call (inside the
    # block) runs in a region. O is replayed in backward after the block has left: its
    # inner call must run in a region again, or torch sees different saved tensors.
    expected = _grads(lambda x, w: _eager_middle(x, w).exp())
    spy = RegionSpy()

    def u(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with cg.patch_torch_checkpoint(spy):
            h = _middle(x, w)
        return h.exp()

    x, w = _leaves()
    with pytest.warns(UserWarning, match="whose forward began before the patch was entered"):
        y = tc.checkpoint(u, x, w, use_reentrant=False)
    assert not installed()
    forward_regions = len(spy.regions)
    y.sum().backward()  # U's replay enters the block again, O's replay comes after it
    assert forward_regions == 1 and len(spy.regions) == 3  # forward, U's replay, O's replay
    assert not installed()
    _same([x.grad, w.grad], expected)  # type: ignore[list-item]


def test_reentrant_call_runs_in_a_region_and_kwargs_still_raise_as_torch() -> None:
    expected = _grads(_eager)
    spy = RegionSpy()
    with cg.patch_torch_checkpoint(spy):
        got = _grads(lambda x, w: tc.checkpoint(_eager, x, w, use_reentrant=True))
        with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
            tc.checkpoint(_eager, *_leaves(), use_reentrant=True, scale=2.0)
    assert len(spy.regions) == 1
    _same(got, expected)


def test_no_grad_call_opens_no_region() -> None:
    with cg.patch_torch_checkpoint() as patch, torch.no_grad():
        seen: list[Region | None] = []
        tc.checkpoint(lambda x: seen.append(current_region()) or x.sin(), _X, use_reentrant=False)
    assert seen == [None] and patch.calls == 0


def test_sac_context_fn_becomes_the_inner_policy_and_others_stay_torchs() -> None:
    expected = _grads(_eager)
    sac = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    spy = RegionSpy()
    with cg.patch_torch_checkpoint(spy) as patch:
        got = _grads(lambda x, w: tc.checkpoint(_eager, x, w, use_reentrant=False, context_fn=sac))
        assert patch.calls == 1
        kept_by = spy.regions[0].summary().kept_by
        assert any("from_torch_sac" in who for who in kept_by), kept_by

        def other() -> tuple[Any, Any]:
            return contextlib.ExitStack(), contextlib.ExitStack()

        with pytest.warns(UserWarning, match=r"context_fn=.*other returned contexts other than"):
            got_other = _grads(
                lambda x, w: tc.checkpoint(_eager, x, w, use_reentrant=False, context_fn=other)
            )
        assert patch.calls == 1
    _same(got, expected)
    _same(got_other, expected)


def test_internals_bound_inside_the_block_act_as_torchs_after_it() -> None:
    # A module imported inside the block may bind the replacement (as the composable
    # checkpoint binds torch's generator at import): outside blocks it is torch's.
    with cg.patch_torch_checkpoint():
        generator = tc._checkpoint_without_reentrant_generator
        function = tc.CheckpointFunction
    assert not installed()
    expected = _grads(_eager)
    seen: list[Region | None] = []

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(current_region())
        return _eager(x, w)

    def via_generator(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gen = generator(body, True, tc.noop_context_fn, "default", False, True, x, w)
        next(gen)
        out = body(x, w)
        with contextlib.suppress(StopIteration):
            next(gen)
        return out

    _same(_grads(via_generator), expected)
    _same(_grads(lambda x, w: function.apply(body, True, x, w)), expected)
    assert seen == [None] * 4  # forward and torch's replay, twice: no region


# --- item 12: calls that bound torch's checkpoint elsewhere --------------------------------


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(16, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _blocks(wrapper: Callable[[torch.nn.Module], torch.nn.Module] | None) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [_Block() for _ in range(3)]
    return torch.nn.Sequential(*(wrapper(b) if wrapper else b for b in blocks))


def _model_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = _X.clone().requires_grad_()
    model(x).square().sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]  # type: ignore[list-item]


def _composable(block: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed._composable import checkpoint

    return checkpoint(block)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "wrapper",
    [
        lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.REENTRANT),
        _composable,
    ],
    ids=["checkpoint_wrapper", "checkpoint_wrapper_reentrant", "composable_checkpoint"],
)
def test_torch_wrappers_bound_at_import_are_routed(wrapper: Any) -> None:
    expected = _model_grads(_blocks(None))
    model = _blocks(wrapper)  # built before the block: the partial is bound already
    spy = RegionSpy()
    with cg.patch_torch_checkpoint(spy) as patch:
        got = _model_grads(model)
    assert patch.calls == 3 and len(spy.regions) == 3
    assert spy.regions[0].opened_by == "patch_torch_checkpoint: _Block"
    _same(got, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own use_reentrant warnings
        _same(_model_grads(model), expected)  # after the block: torch's again


def test_transformers_gradient_checkpointing_is_routed() -> None:
    pytest.importorskip("transformers")
    from .hf_models import batch, build, grads

    # transformers' default checkpoint kwargs for llama (torch's reentrant variant), and
    # use_reentrant=False for gpt2
    for kind, options in (("gpt2", {"use_reentrant": False}), ("llama", None)):
        expected = grads(build(kind, layers=2), batch())
        model = build(kind, layers=2)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        spy = RegionSpy()
        with cg.patch_torch_checkpoint(spy) as patch:
            got = grads(model, batch())
        assert patch.calls == 2 and len(spy.regions) == 2, kind
        assert spy.regions[0].opened_by.startswith("patch_torch_checkpoint: "), kind
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_compiled_checkpoint_stays_torchs_with_a_warning() -> None:
    expected = _grads(_eager)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tc.checkpoint(_eager, x, w, use_reentrant=False)

    with (
        cg.patch_torch_checkpoint() as patch,
        pytest.warns(UserWarning, match="because it was compiled"),
    ):
        got = _grads(compiled)
    assert patch.calls == 0
    _same(got, expected)


def test_routing_pins_torch_internals() -> None:
    # Note [Routing torch's checkpoint calls] relies on these private names of torch.
    from ckpt_graph.integrations import torch_routing

    assert torch_routing.FORWARD_PACK is not None and torch_routing.REPLAY_PACK is not None
    assert torch_routing.FORWARD_PACK.co_freevars == ("frame",)
    assert set(torch_routing.REPLAY_PACK.co_freevars) >= {"target_frame_ref"}
    for name in (
        "_checkpoint_without_reentrant_generator",
        "CheckpointFunction",
        "_checkpoint_hook",
    ):
        assert name in tc.checkpoint.__wrapped__.__globals__ or name in vars(tc)
