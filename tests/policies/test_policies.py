"""Tests for ckpt_graph.policies built-ins: direct calls on a fake ctx, then end to end."""

from __future__ import annotations

import contextlib
import functools
import threading
from types import SimpleNamespace
from typing import Any

import models  # tests/models.py: the shared zoo and run/check helpers
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import ckpt_graph
from ckpt_graph import policies
from ckpt_graph.policies import modules as _modules

aten = torch.ops.aten
MUST_SAVE = CheckpointPolicy.MUST_SAVE
PREFER_SAVE = CheckpointPolicy.PREFER_SAVE
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
PREFER_CPU_OFFLOAD = CheckpointPolicy.PREFER_CPU_OFFLOAD
MUST_CPU_OFFLOAD = CheckpointPolicy.MUST_CPU_OFFLOAD

HAS_ENGINE = hasattr(ckpt_graph, "save_recompute_policy")
needs_engine = pytest.mark.skipif(not HAS_ENGINE, reason="needs the ckpt_graph engine")


def fake_ctx(**overrides: Any) -> SimpleNamespace:
    attrs: dict[str, Any] = dict(
        region=None,
        op_index=0,
        out_bytes=64,
        kept_bytes=0,
        is_random=False,
        is_inplace=False,
        module_path="",
        module=None,
        flops=0,
    )
    attrs.update(overrides)
    return SimpleNamespace(**attrs)


def ask(policy: Any, op: Any, out: Any = None, *args: Any, **kwargs: Any) -> Any:
    return policy(fake_ctx(), out, op, *args, **kwargs)


class _OpLog(TorchDispatchMode):
    """Records the aten ops a function dispatches (what the engine's recorder sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def dispatched_ops(fn: Any, *args: Any) -> list[Any]:
    with _OpLog() as log:
        fn(*args)
    return log.ops


# ---------------------------------------------------------------- save_ops / recompute_ops


@pytest.mark.parametrize(
    ("given", "op", "expected"),
    [
        (aten.mm, aten.mm.default, MUST_SAVE),
        (aten.mm, aten.mm.out, MUST_SAVE),
        (aten.mm.default, aten.mm.default, MUST_SAVE),
        (aten.mm.default, aten.mm.out, PREFER_RECOMPUTE),
        (aten.mm, aten.addmm.default, PREFER_RECOMPUTE),
        (aten.add.Tensor, aten.add.Scalar, PREFER_RECOMPUTE),
    ],
)
def test_save_ops_matches_overload_or_packet(given: Any, op: Any, expected: Any) -> None:
    assert ask(policies.save_ops(given), op) is expected


@pytest.mark.parametrize("factory", [policies.save_ops, policies.recompute_ops])
def test_ops_property_lists_the_ops_as_given(factory: Any) -> None:
    assert factory(aten.mm, aten.addmm.default).ops == (aten.mm, aten.addmm.default)


def test_save_matmuls_ops_exist_in_this_torch() -> None:
    ops = policies.save_matmuls().ops
    assert {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution} <= set(ops)
    assert all(isinstance(op, torch._ops.OpOverloadPacket) for op in ops)


def test_save_ops_rest_none_abstains() -> None:
    policy = policies.save_ops(aten.mm, rest=None)
    assert ask(policy, aten.mm.default) is MUST_SAVE
    assert ask(policy, aten.relu.default) is None


@pytest.mark.parametrize("bad", [torch.mm, "aten.mm", 3])
def test_save_ops_rejects_non_aten_ops(bad: Any) -> None:
    with pytest.raises(
        TypeError, match=r"save_ops: expected aten ops such as torch\.ops\.aten\.mm"
    ):
        policies.save_ops(bad)


@pytest.mark.parametrize(
    ("must", "match_answer"), [(False, PREFER_RECOMPUTE), (True, MUST_RECOMPUTE)]
)
def test_recompute_ops(must: bool, match_answer: Any) -> None:
    policy = policies.recompute_ops(aten.gelu, aten.relu.default, must=must)
    assert ask(policy, aten.gelu.default) is match_answer
    assert ask(policy, aten.relu.default) is match_answer
    assert ask(policy, aten.relu_.default) is None
    assert ask(policy, aten.mm.default) is None


# ---------------------------------------------------------------- save_matmuls

_x = torch.randn(2, 3, 8, dtype=torch.float64)
_w = torch.randn(5, 8, dtype=torch.float64)
_img = torch.randn(1, 2, 6, 6, dtype=torch.float64)
_kernel = torch.randn(3, 2, 3, 3, dtype=torch.float64)
_q = torch.randn(1, 2, 4, 8)


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (lambda x, w: F.linear(x, w), (_x, _w)),
        (lambda x, w: F.linear(x, w, torch.ones(5, dtype=torch.float64)), (_x, _w)),
        (lambda x, w: x @ w.t(), (_x, _w)),
        (lambda x, w: torch.baddbmm(x[..., :3], x, x.transpose(1, 2)), (_x, _w)),
        (lambda i, k: F.conv2d(i, k), (_img, _kernel)),
        (lambda i, k: F.conv_transpose2d(i, k.transpose(0, 1)), (_img, _kernel)),
        (lambda q: F.scaled_dot_product_attention(q, q, q), (_q,)),
    ],
    ids=["linear", "linear_bias", "matmul_3d", "baddbmm", "conv2d", "conv_transpose2d", "sdpa"],
)
def test_save_matmuls_keeps_the_heavy_op_and_recomputes_the_rest(fn: Any, args: Any) -> None:
    ops = dispatched_ops(fn, *args)
    answers = [ask(policies.save_matmuls(), op) for op in ops]
    assert MUST_SAVE in answers, ops
    assert set(answers) <= {MUST_SAVE, PREFER_RECOMPUTE}
    kept = [str(op) for op, a in zip(ops, answers, strict=True) if a is MUST_SAVE]
    assert not any(name.startswith(("aten.view", "aten.t.", "aten._to_copy")) for name in kept)


@pytest.mark.parametrize(
    "fn",
    [torch.relu, torch.sigmoid, lambda t: t + 1, lambda t: t.sum(), lambda t: t.transpose(0, 1)],
)
def test_save_matmuls_recomputes_cheap_ops(fn: Any) -> None:
    ops = dispatched_ops(fn, _x)
    assert ops
    assert all(ask(policies.save_matmuls(), op) is PREFER_RECOMPUTE for op in ops)


# ---------------------------------------------------------------- offload


@pytest.mark.parametrize(
    ("must", "answer"), [(False, PREFER_CPU_OFFLOAD), (True, MUST_CPU_OFFLOAD)]
)
def test_offload_passes_everything_to_select(must: bool, answer: Any) -> None:
    seen: list[Any] = []

    def select(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append((ctx, out, op, args, kwargs))
        return bool(ctx.out_bytes >= 100)

    policy = policies.offload(select, must=must)
    big, small = fake_ctx(out_bytes=100), fake_ctx(out_bytes=99)
    out = torch.ones(2)
    assert policy(big, out, aten.add.Tensor, out, 2, alpha=3) is answer
    assert policy(small, out, aten.add.Tensor) is None
    assert seen[0] == (big, out, aten.add.Tensor, (out, 2), {"alpha": 3})
    assert seen[1][0] is small


def test_offload_rejects_non_callable() -> None:
    with pytest.raises(TypeError, match="offload: select must be a callable"):
        policies.offload(True)  # type: ignore[arg-type]


# ---------------------------------------------------------------- composition


def _const(answer: Any) -> Any:
    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return answer

    return policy


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ((None, PREFER_SAVE, MUST_RECOMPUTE), PREFER_SAVE),
        ((MUST_RECOMPUTE, MUST_SAVE), MUST_RECOMPUTE),
        ((None, True), MUST_SAVE),
        ((False, MUST_SAVE), PREFER_RECOMPUTE),
        ((None, None), None),
    ],
)
def test_first_answer(answers: Any, expected: Any) -> None:
    assert ask(policies.first_answer(*map(_const, answers)), aten.mm.default) is expected


def test_first_answer_stops_at_the_first_answer() -> None:
    calls: list[str] = []

    def spy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        calls.append("spy")

    policy = policies.first_answer(policies.save_ops(aten.mm, rest=None), spy)
    assert ask(policy, aten.mm.default) is MUST_SAVE
    assert calls == []
    assert ask(policy, aten.relu.default) is None
    assert calls == ["spy"]


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ((PREFER_RECOMPUTE, PREFER_SAVE, MUST_SAVE), MUST_SAVE),
        ((PREFER_RECOMPUTE, True), MUST_SAVE),
        ((MUST_RECOMPUTE, PREFER_SAVE), PREFER_SAVE),
        ((None, PREFER_CPU_OFFLOAD, PREFER_RECOMPUTE), PREFER_CPU_OFFLOAD),
        ((None, False), PREFER_RECOMPUTE),
        ((None, None), None),
    ],
)
def test_any_save(answers: Any, expected: Any) -> None:
    assert ask(policies.any_save(*map(_const, answers)), aten.mm.default) is expected


def test_any_save_keeps_the_union_of_selections() -> None:
    policy = policies.any_save(policies.save_ops(aten.mm), policies.save_ops(aten.relu))
    assert ask(policy, aten.mm.default) is MUST_SAVE
    assert ask(policy, aten.relu.default) is MUST_SAVE
    assert ask(policy, aten.gelu.default) is PREFER_RECOMPUTE


def test_any_save_docstring_example() -> None:
    big = policies.offload(lambda ctx, *a, **k: ctx.out_bytes > 4096)
    policy = policies.any_save(big, policies.save_ops(aten.mm))
    for op, out_bytes, expected in [
        (aten.mm.default, 8192, MUST_SAVE),
        (aten.relu.default, 8192, PREFER_CPU_OFFLOAD),
        (aten.relu.default, 64, PREFER_RECOMPUTE),
    ]:
        assert policy(fake_ctx(out_bytes=out_bytes), None, op) is expected


@pytest.mark.parametrize("combinator", [policies.first_answer, policies.any_save])
def test_combinators_reject_bad_policies(combinator: Any) -> None:
    with pytest.raises(ValueError, match="needs at least one policy"):
        combinator()
    with pytest.raises(TypeError, match="expected a policy"):
        combinator(policies.save_matmuls(), 3)


@pytest.mark.parametrize(
    ("name", "expected"), [("recompute_all", PREFER_RECOMPUTE), ("must_save_all", MUST_SAVE)]
)
def test_combinators_accept_string_names(name: str, expected: Any) -> None:
    policy = policies.first_answer(policies.save_ops(aten.mm, rest=None), name)
    assert ask(policy, aten.mm.default) is MUST_SAVE
    assert ask(policy, aten.relu.default) is expected
    assert repr(policy) == f"first_answer(save_ops(aten.mm, rest=None), {name!r})"


@pytest.mark.parametrize("combinator", [policies.first_answer, policies.any_save])
def test_combinators_reject_unknown_names(combinator: Any) -> None:
    with pytest.raises(ValueError, match="unknown policy 'save_all'"):
        combinator("save_all")


# ---------------------------------------------------------------- from_torch_sac


def test_from_torch_sac_function_gets_a_torch_style_ctx() -> None:
    seen: list[Any] = []

    def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((ctx.is_recompute, ctx.op_output, op, args, kwargs))
        return op == aten.mm.default

    policy = policies.from_torch_sac(sac_policy)
    out = torch.zeros(1)
    assert policy(fake_ctx(), out, aten.mm.default, 1, k=2) is True
    assert policy(fake_ctx(), out, aten.relu.default) is False
    assert seen[0] == (False, out, aten.mm.default, (1,), {"k": 2})


def test_from_torch_sac_op_list_means_what_torch_means() -> None:
    # torch: "equivalent to a policy returning MUST_SAVE for the specified operations and
    # PREFER_RECOMPUTE for all other operations"
    policy = policies.from_torch_sac([aten.mm.default, aten.addmm.default])
    assert ask(policy, aten.mm.default) is MUST_SAVE
    assert ask(policy, aten.addmm.default) is MUST_SAVE
    assert ask(policy, aten.mm.out) is PREFER_RECOMPUTE
    assert ask(policy, aten.relu.default) is PREFER_RECOMPUTE


def test_from_torch_sac_rejects_other_things() -> None:
    with pytest.raises(TypeError, match="from_torch_sac: expected a SAC policy function"):
        policies.from_torch_sac(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- repr


def _select_big(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return True


@pytest.mark.parametrize(
    ("policy", "text"),
    [
        (
            lambda: policies.save_ops(aten.mm, aten.addmm.default),
            "save_ops(aten.mm, aten.addmm.default)",
        ),
        (lambda: policies.save_ops(aten.mm, rest=None), "save_ops(aten.mm, rest=None)"),
        (
            lambda: policies.recompute_ops(aten.gelu, must=True),
            "recompute_ops(aten.gelu, must=True)",
        ),
        (lambda: policies.save_matmuls(), "save_matmuls()"),
        (lambda: policies.offload(_select_big), "offload(_select_big)"),
        (
            lambda: policies.first_answer(
                policies.save_matmuls(), policies.recompute_ops(aten.relu)
            ),
            "first_answer(save_matmuls(), recompute_ops(aten.relu))",
        ),
        (lambda: policies.any_save(policies.save_matmuls()), "any_save(save_matmuls())"),
        (lambda: policies.from_torch_sac([aten.mm.default]), "from_torch_sac([aten.mm.default])"),
        (lambda: policies.from_torch_sac(_select_big), "from_torch_sac(_select_big)"),
        (lambda: policies.save_module_outputs("layers.*"), "save_module_outputs('layers.*')"),
        (lambda: policies.save_module_outputs(nn.Linear), "save_module_outputs(Linear)"),
        (lambda: policies.save_module_outputs((nn.Linear,)), "save_module_outputs((Linear,))"),
    ],
)
def test_repr_names_the_policy(policy: Any, text: str) -> None:
    assert repr(policy()) == text


# ---------------------------------------------------------------- save_module_outputs


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("layers.*", "layers.0", True),
        ("layers.*", "layers.0.mlp", False),
        ("layers.*", "layers", False),
        ("layers.**", "layers.0.mlp", True),
        ("**.mlp", "mlp", True),
        ("**.mlp", "layers.3.mlp", True),
        ("**.mlp", "layers.3.mlp.fc", False),
        ("layers.[0-1].mlp", "layers.1.mlp", True),
        ("layers.[0-1].mlp", "layers.2.mlp", False),
        ("layers.?", "layers.10", False),
        ("head", "head", True),
        ("", "", True),
        ("", "head", False),
    ],
)
def test_name_patterns(pattern: str, name: str, expected: bool) -> None:
    assert _modules.name_matches(pattern, name) is expected


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(torch.tanh(x))


def _tagged_by(policy: Any, model: nn.Module, x: torch.Tensor, monkeypatch: Any) -> Any:
    """Run model with the policy's hooks active; return what it tagged and each module's output."""
    tagged: list[Any] = []
    monkeypatch.setattr(_modules, "tag_outputs", tagged.append)
    outputs: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_hook(lambda m, a, o, name=name: outputs.__setitem__(name, o))
        for name, m in model.named_modules()
    ]
    policy.on_region_enter(None)
    try:
        model(x)
    finally:
        policy.on_region_exit(None)
        for h in handles:
            h.remove()
    return tagged, outputs


@pytest.mark.parametrize(
    ("match", "names"),
    [
        ("layers.*", ["layers.0", "layers.1", "layers.2", "layers.3"]),
        ("**.mlp", ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp", "layers.3.mlp"]),
        ("layers.2.mlp.0", ["layers.2.mlp.0"]),
        ("**.norm", ["layers.0.norm", "layers.1.norm", "layers.2.norm", "layers.3.norm"]),
        (Block, ["layers.0", "layers.1", "layers.2", "layers.3"]),
        ((nn.LayerNorm, nn.GELU), [f"layers.{i}.{s}" for i in range(4) for s in ("norm", "mlp.1")]),
        (
            lambda name, m: isinstance(m, Block) and int(name.split(".")[-1]) % 2 == 0,
            ["layers.0", "layers.2"],
        ),
        ("", [""]),
        ("head", ["head"]),
    ],
)
def test_save_module_outputs_selects_modules(
    match: Any, names: list[str], monkeypatch: Any
) -> None:
    torch.manual_seed(0)
    model = Stack()
    tagged, outputs = _tagged_by(
        policies.save_module_outputs(match), model, torch.randn(2, 8), monkeypatch
    )
    assert [id(t) for t in tagged] == [id(outputs[n]) for n in names]


def test_save_module_outputs_names_agree_with_named_modules(monkeypatch: Any) -> None:
    seen: list[str] = []

    def record(name: str, module: nn.Module) -> bool:
        seen.append(name)
        return False

    model = Stack()
    _tagged_by(policies.save_module_outputs(record), model, torch.randn(2, 8), monkeypatch)
    called = [name for name, m in model.named_modules() if not isinstance(m, nn.ModuleList)]
    assert sorted(seen) == sorted(called)


def test_save_module_outputs_answers_prefer_recompute_for_every_op() -> None:
    policy = policies.save_module_outputs(Block)
    for op in dispatched_ops(Stack(), torch.randn(2, 8)):
        assert ask(policy, op) is PREFER_RECOMPUTE


def test_save_module_outputs_hooks_are_removed_and_thread_local(monkeypatch: Any) -> None:
    before = (
        len(nn.modules.module._global_forward_pre_hooks),
        len(nn.modules.module._global_forward_hooks),
    )
    tagged: list[Any] = []
    monkeypatch.setattr(_modules, "tag_outputs", tagged.append)
    policy = policies.save_module_outputs(nn.Linear)
    layer = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    policy.on_region_enter("outer")
    policy.on_region_enter("inner")  # nested use keeps one set of hooks
    assert len(nn.modules.module._global_forward_hooks) == before[1] + 1
    policy.on_region_exit("inner")
    thread = threading.Thread(target=layer, args=(x,))
    thread.start()
    thread.join()
    assert tagged == []  # another thread's module calls are not this region's
    layer(x)
    assert len(tagged) == 1
    policy.on_region_exit("outer")
    layer(x)
    assert len(tagged) == 1
    after = (
        len(nn.modules.module._global_forward_pre_hooks),
        len(nn.modules.module._global_forward_hooks),
    )
    assert after == before


def test_save_module_outputs_survives_a_forward_that_raises(monkeypatch: Any) -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.boom = Boom()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with contextlib.suppress(RuntimeError):
                self.boom(x)
            return self.lin(x)

    model = Parent()
    tagged, outputs = _tagged_by(
        policies.save_module_outputs("lin"), model, torch.randn(1, 2), monkeypatch
    )
    assert [id(t) for t in tagged] == [id(outputs["lin"])]


@pytest.mark.parametrize("bad", [int, (nn.Linear, int), (), 3])
def test_save_module_outputs_rejects_bad_match(bad: Any) -> None:
    with pytest.raises(TypeError, match="save_module_outputs: "):
        policies.save_module_outputs(bad)


# ---------------------------------------------------------------- end to end (needs the engine)

MATMUL_PACKETS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution}


def _is_matmul(op: Any) -> bool:
    return op.overloadpacket in MATMUL_PACKETS or str(op).startswith("aten._scaled_dot_product")


def _kept(region: Any, reasons: tuple[str, ...] = ("policy", "tag")) -> set[tuple[int, int]]:
    """(node index, output index) of the values the region kept by policy or tag."""
    return {
        (node.index, h.output_index)
        for node in region.nodes
        for h in node.outputs
        if h is not None and h.reason in reasons
    }


def _outputs_where(region: Any, pred: Any) -> set[tuple[int, int]]:
    return {
        (node.index, h.output_index)
        for node in region.nodes
        for h in node.outputs
        if h is not None and pred(node)
    }


def _sac_mm_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    assert ctx.is_recompute is False
    return MUST_SAVE if op.overloadpacket in (aten.addmm, aten.mm) else PREFER_RECOMPUTE


def _select_wide(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return bool(ctx.out_bytes >= 256)


E2E_POLICIES = {
    "save_ops": lambda: policies.save_ops(aten.addmm, aten.mm.default),
    "save_matmuls": policies.save_matmuls,
    "recompute_ops": lambda: policies.recompute_ops(aten.gelu, aten.native_layer_norm),
    "save_module_outputs": lambda: policies.save_module_outputs("blocks.*"),
    "offload": lambda: policies.offload(_select_wide),
    "first_answer": lambda: policies.first_answer(
        policies.save_ops(aten.addmm, rest=None), "recompute_all"
    ),
    "any_save": lambda: policies.any_save(
        policies.save_ops(aten.addmm), policies.save_module_outputs("blocks.*")
    ),
    "from_torch_sac_list": lambda: policies.from_torch_sac([aten.addmm.default]),
    "from_torch_sac_fn": lambda: policies.from_torch_sac(_sac_mm_policy),
}


@needs_engine
@pytest.mark.parametrize("name", list(E2E_POLICIES))
@pytest.mark.parametrize("model_name", ["mlp", "cnn", "transformer"])
def test_gradients_match_eager(model_name: str, name: str) -> None:
    model, x = models.make_model(model_name)
    models.check(model, [x], E2E_POLICIES[name]())


@needs_engine
@pytest.mark.parametrize("model_name", ["mlp", "cnn", "transformer"])
def test_save_matmuls_keeps_exactly_the_matmuls(model_name: str) -> None:
    model, x = models.make_model(model_name)
    _, got = models.check(model, [x], policies.save_matmuls())
    region = got.region
    assert _kept(region, ("policy",)) == _outputs_where(region, lambda n: _is_matmul(n.op))
    for node in region.nodes:
        if _is_matmul(node.op):
            assert node.decision is MUST_SAVE and node.realized == 0, node
    assert any(n.realized for n in region.nodes if not _is_matmul(n.op))


@needs_engine
def test_save_ops_packet_keeps_every_overload_but_overload_only_itself() -> None:
    model, x = models.make_model("transformer")
    _, by_packet = models.check(model, [x], policies.save_ops(aten.addmm))
    _, by_overload = models.check(model, [x], policies.save_ops(aten.addmm.out))
    addmm = _outputs_where(by_packet.region, lambda n: n.op.overloadpacket is aten.addmm)
    assert addmm and _kept(by_packet.region) == addmm
    assert _kept(by_overload.region) == set()


@needs_engine
def test_recompute_ops_alone_keeps_everything_else() -> None:
    model, x = models.make_model("mlp")
    _, got = models.check(model, [x], policies.recompute_ops(aten.gelu))
    region = got.region
    gelu = _outputs_where(region, lambda n: n.op.overloadpacket is aten.gelu)
    assert gelu
    assert _kept(region) == _outputs_where(region, lambda n: True) - gelu


@needs_engine
@pytest.mark.parametrize(
    ("match", "paths"),
    [
        ("blocks.*", ["blocks.0.2", "blocks.1.2", "blocks.2.2"]),
        (nn.GELU, ["blocks.0.1", "blocks.1.1", "blocks.2.1"]),
        (lambda name, m: name in ("blocks.0", "out"), ["blocks.0.2", "out"]),
    ],
)
def test_save_module_outputs_keeps_the_module_outputs(match: Any, paths: list[str]) -> None:
    # In MLP, block i is Sequential(Linear, GELU, Linear): its output is made by blocks.i.2's op.
    model, x = models.make_model("mlp")
    _, got = models.check(model, [x], policies.save_module_outputs(match))
    region = got.region
    kept = sorted(_kept(region))
    assert [region.nodes[i].module_path for i, _ in kept] == paths
    assert all(region.nodes[i].outputs[j] in region.tagged for i, j in kept)
    assert region.kept_bytes == sum(region.nodes[i].outputs[j].nbytes for i, j in kept)


@needs_engine
def test_save_module_outputs_pushed_inside_the_model_uses_the_engine_names() -> None:
    # The policy enters with block 1 (a nested block inside the model's forward): names are
    # still relative to the model, the outermost module of the region.
    model, x = models.make_model("mlp")
    model.block_policy = {1: policies.save_module_outputs("blocks.1.*")}
    _, got = models.check(model, [x], "recompute_all")
    region = got.region
    assert [region.nodes[i].module_path for i, _ in sorted(_kept(region))] == [
        "blocks.1.0",
        "blocks.1.1",
        "blocks.1.2",
    ]


@needs_engine
def test_offload_on_cpu_keeps_exactly_the_selected_values() -> None:
    model, x = models.make_model("mlp")
    policy = policies.first_answer(policies.offload(_select_wide), "recompute_all")
    region = models.check(model, [x], policy)[1].region
    wide = _outputs_where(region, lambda n: sum(h.nbytes for h in n.outputs if h) >= 256)
    assert wide and _kept(region) == wide
    for node in region.nodes:
        selected = (node.index, 0) in wide
        assert (node.decision is PREFER_CPU_OFFLOAD) == selected, node
        assert all(h is None or h.offload_device is None for h in node.outputs)  # CPU: no copy


@needs_engine
def test_conflicting_must_answers_name_both_policies() -> None:
    model, x = models.make_model("mlp")
    model.block_policy = {1: policies.recompute_ops(aten.addmm, must=True)}
    with (
        pytest.raises(
            ckpt_graph.CkptGraphError,
            match=r"save_matmuls\(\) answered MUST_SAVE and "
            r"recompute_ops\(aten\.addmm, must=True\) answered MUST_RECOMPUTE",
        ),
        ckpt_graph.save_recompute_policy(policies.save_matmuls()),
    ):
        model(x)


@needs_engine
@pytest.mark.parametrize(
    "sac", [[aten.addmm.default], _sac_mm_policy], ids=["op_list", "policy_fn"]
)
def test_from_torch_sac_matches_torch_checkpoint(sac: Any) -> None:
    model, x = models.make_model("mlp")
    ref = models.run(model, [x], policies.from_torch_sac(sac))

    def torch_sac(m: Any, inp: torch.Tensor) -> torch.Tensor:
        context_fn = functools.partial(create_selective_checkpoint_contexts, sac)
        return checkpoint(m, inp, use_reentrant=False, context_fn=context_fn)  # type: ignore[no-any-return]

    got = models.run(torch_sac, [model, x], None)
    torch.testing.assert_close(got.outputs, ref.outputs, rtol=0, atol=0)
    torch.testing.assert_close(got.grads[1:], ref.grads[1:], rtol=0, atol=0)  # [0]: x, no grad
    assert _kept(ref.region) == _outputs_where(ref.region, lambda n: n.op is aten.addmm.default) | (
        set()
        if isinstance(sac, list)
        else _outputs_where(ref.region, lambda n: n.op is aten.mm.default)
    )


@needs_engine
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_keeps_values_in_host_memory() -> None:
    model, x = models.make_model("mlp")
    model, x = model.cuda(), x.cuda()
    with ckpt_graph.save_recompute_policy(policies.offload(_select_wide)) as region:
        y = model(x)
    offloaded = [
        h for n in region.nodes for h in n.outputs if h is not None and h.offload_device is not None
    ]
    assert offloaded and all(h.value.device.type == "cpu" for h in offloaded)
    y.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for a, b in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# Every default built-in, for the nesting tests. See Note [Built-in policy strengths].
DEFAULT_BUILTINS = {
    **{k: v for k, v in E2E_POLICIES.items() if not k.startswith("from_torch_sac")},
    "recompute_all": lambda: "recompute_all",
    "must_save_all": lambda: "must_save_all",
}
# Disjoint selections on the MLP: tanh runs outside the blocks, GELU and matmuls inside them.
SAVE_SELECTIONS = {
    "save_ops": lambda: policies.save_ops(aten.tanh),
    "save_matmuls": policies.save_matmuls,
    "save_module_outputs": lambda: policies.save_module_outputs(nn.GELU),
}


def _kept_under(
    outer: str, inner: str | None = None, table: Any = DEFAULT_BUILTINS
) -> tuple[Any, set[tuple[int, int]]]:
    """Run the MLP under ``outer``, with ``inner`` pushed around every block; check grads."""
    model, x = models.make_model("mlp")
    if inner is not None:
        model.block_policy = {i: table[inner]() for i in range(len(model.blocks))}
    got = models.run(model, [x], table[outer]())
    models.assert_same(_mlp_reference(), got)
    return got.region, _kept(got.region)


@functools.cache
def _mlp_reference() -> Any:
    model, x = models.make_model("mlp")
    return models.run(model, [x], None)


@needs_engine
@pytest.mark.parametrize("inner", list(DEFAULT_BUILTINS))
@pytest.mark.parametrize("outer", list(DEFAULT_BUILTINS))
def test_default_builtins_nest_without_conflict(outer: str, inner: str) -> None:
    _kept_under(outer, inner)  # raises CkptGraphError on a conflict; checks gradients


@needs_engine
@pytest.mark.parametrize("inner", SAVE_SELECTIONS)
@pytest.mark.parametrize("outer", SAVE_SELECTIONS)
def test_nested_save_selections_keep_the_union(outer: str, inner: str) -> None:
    region, both = _kept_under(outer, inner, SAVE_SELECTIONS)
    _, outer_alone = _kept_under(outer, None, SAVE_SELECTIONS)
    _, inner_alone = _kept_under(inner, None, SAVE_SELECTIONS)
    assert outer_alone and inner_alone
    # The inner policy only sees the ops of the blocks it is pushed around.
    in_blocks = {k for k in inner_alone if region.nodes[k[0]].module_path.startswith("blocks.")}
    assert both == outer_alone | in_blocks


@needs_engine
def test_one_module_policy_in_regions_of_two_threads() -> None:
    policy = policies.save_module_outputs("blocks.*")
    _, alone = _kept_under("save_module_outputs")
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]

    class Paced(nn.Module):
        """Waits for the other thread once, so that both regions are open at the same time."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            barrier.wait(timeout=30)
            return x

    def worker(i: int) -> None:
        model, x = models.make_model("mlp")
        model.blocks.insert(1, Paced())
        with ckpt_graph.save_recompute_policy(policy) as region:
            out = model(x)
        out.sum().backward()
        results[i] = region

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for region in results:
        assert region is not None
        # blocks.1 is the pacing module: it returns blocks.0's output, tagged already
        paths = [region.nodes[i].module_path for i, _ in sorted(_kept(region))]
        assert paths == ["blocks.0.2", "blocks.2.2", "blocks.3.2"]
    assert len(alone) == 3


@needs_engine
def test_save_module_outputs_tags_every_tensor_of_a_structured_output() -> None:
    class TwoHeads(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            return {"pair": (x.sin(), x.cos()), "scale": 2.0, "sq": [x * x]}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = TwoHeads()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.heads(x.exp())
            return (out["pair"][0] * out["pair"][1] + out["sq"][0]).sum() * out["scale"]

    x = models.leaf(3, 4)
    _, got = models.check(Model(), [x], policies.save_module_outputs("heads"))
    region = got.region
    kept = {region.nodes[i].op for i, _ in _kept(region)}
    assert kept == {aten.sin.default, aten.cos.default, aten.mul.Tensor}
    assert all(region.nodes[i].outputs[j] in region.tagged for i, j in _kept(region))


def _graph_facts(region: Any) -> list[tuple[Any, ...]]:
    facts = []
    for n in region.nodes:
        outs = tuple(
            None
            if h is None
            else (h.reason, tuple(h.shape), h.is_view, h.has_views, h.forward_uses, h.saved_refs)
            for h in n.outputs
        )
        ins = tuple((h.node_index, h.output_index, h.input_index) for h in n.inputs)
        facts.append((n.info.name, n.decision, n.decided_by, n.module_path, ins, outs))
    return facts


@pytest.mark.parametrize("name", models.ZOO)
@pytest.mark.parametrize(
    "policy",
    [models.save_matmuls, policies.save_matmuls(), "recompute_all"],
    ids=["function", "save_matmuls", "recompute_all"],
)
def test_debug_region_records_what_a_plain_region_does(name: str, policy: Any) -> None:
    """See Note [One recording path]: a debug region adds checks to the recording, never
    another way of recording: the graph, decisions, kept values and gradients are the same."""

    def forward(debug: bool) -> tuple[Any, list[torch.Tensor]]:
        model, x = models.make_model(name)
        with ckpt_graph.save_recompute_policy(policy, debug=debug) as region:
            y = model(x)
        facts = _graph_facts(region)
        y.sum().backward()
        return facts, [p.grad for p in model.parameters()]

    plain = forward(False)
    debug = forward(True)
    assert plain[0] == debug[0]
    for a, b in zip(plain[1], debug[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
