"""HuggingFace GPT-2, Llama and BERT (tiny, random init): exact gradients, lower peak memory.

Float32 gradients are compared bitwise: the recompute runs the very aten calls of the forward on
the same values, and these CPU kernels are deterministic for a fixed thread count.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckpt_graph as cg
from ckpt_graph.integrations.wrap import unwrap, wrap
from ckpt_graph.memory import measure
from ckpt_graph.policies import memory_budget, save_module_outputs

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (pip install transformers)"
)

from ckpt_graph.integrations import transformers as cg_hf  # noqa: E402

from .hf_models import batch, build, grads, loss  # noqa: E402

KINDS = [("gpt2", "sdpa"), ("gpt2", "eager"), ("llama", "sdpa"), ("bert", "sdpa")]


def _layer_outputs() -> Any:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return save_module_outputs(GradientCheckpointingLayer)


@functools.cache
def _reference(kind: str, attn: str) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients and peak bytes of a step without checkpointing."""
    model, ids = build(kind, attn, layers=2), batch()
    ref = grads(model, ids)
    return ref, measure(_step, model, ids).peak_bytes


def _step(model: Any, ids: torch.Tensor) -> None:
    loss(model, ids).backward()


def _whole(policy: Any) -> Callable[[Any, torch.Tensor], None]:
    def step(model: Any, ids: torch.Tensor) -> None:
        with cg.save_recompute_policy(policy):
            out = loss(model, ids)
        out.backward()

    return step


def _setup(mode: str, model: Any) -> Callable[[Any, torch.Tensor], None]:
    if mode == "wrap":
        wrap(model)
    elif mode == "enable":
        cg_hf.enable(model)
    elif mode == "whole_recompute_all":
        return _whole("recompute_all")
    elif mode == "whole_layer_outputs":
        return _whole(_layer_outputs())
    return _step


@pytest.mark.parametrize(("kind", "attn"), KINDS)
@pytest.mark.parametrize("mode", ["wrap", "enable", "whole_recompute_all", "whole_layer_outputs"])
def test_gradients_bitwise_equal_and_peak_lower(kind: str, attn: str, mode: str) -> None:
    ref, plain_peak = _reference(kind, attn)
    model, ids = build(kind, attn, layers=2), batch()
    step = _setup(mode, model)
    step(model, ids)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)
    if mode == "whole_recompute_all":
        # One region over everything with recompute_all recomputes the whole residual chain at
        # the first unpack unless the recompute cache is bounded: no memory assertion here.
        return
    model.zero_grad(set_to_none=False)
    peak = measure(step, model, ids).peak_bytes
    assert peak < 0.8 * plain_peak, (peak, plain_peak)


def test_enable_disable_and_train_mode_only() -> None:
    model, ids = build("llama", layers=3), batch()
    regions: list[int] = []

    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        regions.append(id(ctx.region))

    assert cg_hf.enable(model, policy=policy) is model
    assert cg_hf.is_enabled(model) and model.is_activation_checkpointing
    loss(model, ids)
    assert len(set(regions)) == 3  # one region per decoder layer
    regions.clear()
    model.eval()
    loss(model, ids)
    assert regions == []  # transformers checkpoints in training mode only
    model.train()
    cg_hf.disable(model)
    assert not cg_hf.is_enabled(model) and not model.is_activation_checkpointing
    loss(model, ids)
    assert regions == []
    cg_hf.enable(model, policy=policy, every_n_layers=2)
    loss(model, ids)
    assert len(set(regions)) == 2  # layers 0 and 2


def test_enable_leaves_state_dict_and_hooks() -> None:
    model = build("gpt2", layers=2)
    keys = list(model.state_dict())
    calls: list[str] = []
    model.transformer.h[0].register_forward_hook(lambda m, a, o: calls.append("post"))
    cg_hf.enable(model)
    loss(model, batch()).backward()
    assert list(model.state_dict()) == keys
    assert calls == ["post"]


def test_enable_wrong_model_and_missing_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="takes a transformers PreTrainedModel, got Linear"):
        cg_hf.enable(torch.nn.Linear(2, 2))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs the 'transformers' package"):
        cg_hf.enable(torch.nn.Linear(2, 2))


def test_wrap_and_unwrap_hf_model_keeps_names() -> None:
    model = build("bert", layers=2)
    names = [n for n, _ in model.named_parameters()]
    wrap(model)
    assert [n for n, _ in model.named_parameters()] == names
    unwrap(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    ("policy", "lowered"),
    [("recompute_all", True), (memory_budget(0.5), True), (memory_budget("64MiB"), False)],
)
def test_checkpoint_function_under_torch_compile(policy: object, lowered: bool) -> None:
    """Lowered to torch's checkpoint (one graph), or eager with a warning for a policy that
    needs the region at run time. See Note [HF checkpoint function]."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    (lin(x) * 2).sum().backward()
    expected = [lin.weight.grad.clone(), x.grad.clone()]  # type: ignore[union-attr]
    lin.zero_grad(set_to_none=True)
    x.grad = None
    function = cg_hf.HFCheckpointFunction(policy)
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter)
    def f(inp: torch.Tensor) -> torch.Tensor:
        return function(lin, inp) * 2

    if lowered:
        f(x).sum().backward()
        assert counter.frame_count == 1
    else:
        with pytest.warns(UserWarning, match="runs eagerly under torch.compile"):
            f(x).sum().backward()
    torch.testing.assert_close([lin.weight.grad, x.grad], expected, rtol=0, atol=0)
    torch._dynamo.reset()
