"""ckpt_graph.wrap / unwrap: regions per submodule without changing the module tree."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckpt_graph.engine.region import current_region
from ckpt_graph.integrations.wrap import RegionForward, is_wrapped, unwrap, wrap
from ckpt_graph.memory import measure


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _policy_regions() -> tuple[Callable[..., Any], list[int]]:
    """A policy that abstains and records which region asked (by id)."""
    seen: list[int] = []

    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(id(ctx.region))
        return None

    return policy, seen


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_wrap_gradients_bitwise_equal(policy: str) -> None:
    model = _net()
    x = torch.randn(8, 16, dtype=torch.float64)
    expected = _grads(model, x)
    wrap(model, policy=policy)
    torch.testing.assert_close(_grads(model, x), expected, rtol=0, atol=0)
    unwrap(model)
    torch.testing.assert_close(_grads(model, x), expected, rtol=0, atol=0)


def test_wrap_lowers_peak_memory() -> None:
    model = _net()
    x = torch.randn(256, 16, dtype=torch.float64)
    _grads(model, x)  # allocate .grad first so only activations differ

    def step() -> None:
        model(x).sum().backward()

    plain = measure(step).peak_bytes
    wrap(model)
    wrapped = measure(step).peak_bytes
    assert wrapped < 0.7 * plain, (wrapped, plain)


def test_default_match_is_one_region_per_module_list_child() -> None:
    model = _net()
    policy, seen = _policy_regions()
    wrap(model, policy=policy)
    assert [is_wrapped(m) for m in model.modules()].count(True) == 3
    assert all(is_wrapped(b) for b in model.blocks)
    model(torch.randn(2, 16, dtype=torch.float64))
    assert len(set(seen)) == 3  # three regions, nothing outside the blocks recorded


def test_module_tree_state_dict_and_class_unchanged() -> None:
    model = _net()
    before = (
        list(model.state_dict().keys()),
        [n for n, _ in model.named_parameters()],
        [(n, type(m)) for n, m in model.named_modules()],
    )
    wrap(model)
    after = (
        list(model.state_dict().keys()),
        [n for n, _ in model.named_parameters()],
        [(n, type(m)) for n, m in model.named_modules()],
    )
    assert after == before
    assert all(type(b) is Block for b in model.blocks)
    model.load_state_dict(_net().state_dict())  # keys still line up


def test_hooks_fire_once_outside_the_region() -> None:
    model = _net()
    events: list[tuple[str, bool]] = []
    block = model.blocks[1]
    block.register_forward_pre_hook(lambda m, a: events.append(("pre", current_region() is None)))
    block.register_forward_hook(lambda m, a, o: events.append(("post", current_region() is None)))
    wrap(model)
    model(torch.randn(2, 16, dtype=torch.float64)).sum().backward()
    assert events == [("pre", True), ("post", True)]


def test_wrap_is_idempotent_and_unwrap_restores() -> None:
    model = _net()
    wrap(model)
    forwards = [b.__dict__["forward"] for b in model.blocks]
    assert wrap(model, policy="must_save_all") is model
    assert [b.__dict__["forward"] for b in model.blocks] == forwards
    assert all(f.policy == "must_save_all" for f in forwards)
    assert unwrap(model) is model
    assert not any("forward" in m.__dict__ for m in model.modules())
    unwrap(model)  # no-op


def test_previous_instance_forward_is_called_and_restored() -> None:
    model = _net()
    block = model.blocks[0]
    calls: list[int] = []
    original = block.forward

    def patched(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return original(x)

    block.forward = patched  # type: ignore[method-assign]
    wrap(model)
    model(torch.randn(2, 16, dtype=torch.float64))
    assert calls == [1]
    unwrap(model)
    assert block.forward is patched


@pytest.mark.parametrize(
    ("match", "expected"),
    [
        (Block, ["blocks.0", "blocks.1", "blocks.2"]),
        ((torch.nn.LayerNorm, torch.nn.Embedding), [f"blocks.{i}.norm" for i in range(3)]),
        ("blocks.*.up", ["blocks.0.up", "blocks.1.up", "blocks.2.up"]),
        (lambda name, m: name in ("embed", "head"), ["embed", "head"]),
        ("blocks.1*", ["blocks.1"]),  # blocks.1.up etc. are inside blocks.1
        (lambda name, m: name == "", [""]),  # the whole forward in one region
    ],
)
def test_match_kinds(match: Any, expected: list[str]) -> None:
    model = _net()
    x = torch.randn(4, 16, dtype=torch.float64)
    ref = _grads(model, x)
    wrap(model, match=match)
    assert [n for n, m in model.named_modules() if is_wrapped(m)] == expected
    torch.testing.assert_close(_grads(model, x), ref, rtol=0, atol=0)


def test_whole_model_region_is_one_region() -> None:
    model = _net()
    policy, seen = _policy_regions()
    wrap(model, policy=policy, match=lambda name, m: name == "")
    model(torch.randn(2, 16, dtype=torch.float64))
    assert len(seen) > 10 and len(set(seen)) == 1


def test_bad_match_raises() -> None:
    model = _net()
    with pytest.raises(TypeError, match=re.escape("ckpt_graph: wrap(match=...) takes")):
        wrap(model, match=3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=re.escape("ckpt_graph: wrap() found nothing matched 'nope'")
    ):
        wrap(model, match="nope")
    with pytest.raises(ValueError, match=r"no nn\.ModuleList children"):
        wrap(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"takes an nn\.Module"):
        wrap(lambda x: x)  # type: ignore[arg-type]


def test_deepcopy_of_wrapped_model_runs_on_the_copy() -> None:
    model = wrap(_net())
    clone = copy.deepcopy(model)
    for b in clone.blocks:
        forward = b.__dict__["forward"]
        assert isinstance(forward, RegionForward) and forward.module is b
    x = torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(_grads(clone, x), _grads(model, x), rtol=0, atol=0)


def test_warns_about_compiled_submodules_inside_a_selected_module() -> None:
    model = _net()
    model.blocks[0].up.compile(backend="eager")
    with pytest.warns(
        UserWarning, match="contains compiled submodules \\('up'\\); they run eagerly"
    ):
        wrap(model)
