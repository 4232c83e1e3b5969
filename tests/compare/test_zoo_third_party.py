"""Every third-party zoo model builds and trains one step under ckpt_graph with exact gradients.

The models of ``compare.third_party`` (and transformers' GPT-2 and Llama of ``compare.zoo``)
at tiny sizes, with dropout 0.1 where the model has dropout: one region with
``recompute_all`` over the forward against the same step without checkpointing, bitwise
(float32 CPU kernels are deterministic; dropout masks are replayed). Skipped, with the reason,
where the model's library is not installed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

import ckpt_graph as cg
from ckpt_graph.compare.third_party import SPECS
from ckpt_graph.compare.zoo import THIRD_PARTY, TINY_SIZES, Workload, build_workload

LIBRARY = {**{n: s.library for n, s in SPECS.items()}, "hf-gpt2": "transformers"}
LIBRARY["hf-llama"] = "transformers"

MODELS = ["hf-gpt2", "hf-llama", *THIRD_PARTY]


pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_zoo_model_has_tiny_sizes() -> None:
    assert set(TINY_SIZES) == set(MODELS)
    assert len(MODELS) >= 12


def _workload(name: str) -> Workload:
    library = LIBRARY[name]
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{name} needs the {library!r} package, which is not installed")
    return build_workload(name, **TINY_SIZES[name], dropout=0.1)  # type: ignore[arg-type]


def step_workload(w: Workload, initial: dict[str, torch.Tensor], policy: object) -> dict[str, Any]:
    """One training step of ``w`` from ``initial`` under ``policy`` (``None``: no region): the
    loss, gradients, buffers and generator state after it. The beyond-zoo tests share it."""
    w.model.load_state_dict(initial)
    for p in w.model.parameters():
        p.grad = None
    torch.manual_seed(0)
    if policy is None:
        out = w.model(*w.inputs)
    else:
        with cg.save_recompute_policy(policy):  # type: ignore[arg-type]
            out = w.model(*w.inputs)
    loss = w.loss(out)
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in w.model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in w.model.named_buffers()},
        "rng": torch.get_rng_state(),
    }


@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_recompute_all_exact(name: str) -> None:
    w = _workload(name)
    assert len(w.blocks) >= 2 and all(isinstance(b, torch.nn.Module) for b in w.blocks)
    initial = {k: v.clone() for k, v in w.model.state_dict().items()}
    ref = step_workload(w, initial, None)
    got = step_workload(w, initial, "recompute_all")
    exact: dict[str, Any] = dict(rtol=0, atol=0)
    torch.testing.assert_close(got["loss"], ref["loss"], **exact)
    assert ref["grads"].keys() == got["grads"].keys()
    used = [n for n, g in ref["grads"].items() if g is not None]
    assert len(used) > len(ref["grads"]) // 2, "most parameters should get a gradient"
    for n, g in ref["grads"].items():
        assert (g is None) == (got["grads"][n] is None), n
        if g is not None:
            torch.testing.assert_close(got["grads"][n], g, **exact, msg=lambda m, n=n: f"{n}: {m}")
    for n, b in ref["buffers"].items():  # BatchNorm running stats updated exactly once
        torch.testing.assert_close(got["buffers"][n], b, **exact, msg=lambda m, n=n: f"{n}: {m}")
    torch.testing.assert_close(got["rng"], ref["rng"], **exact)  # replay left the stream alone


def test_zoo_blocks_in_forward_order() -> None:
    # The UNet's blocks are listed by one forward (down, mid, up), not by registration order.
    w = _workload("diffusers-unet")
    names = {id(m): n for n, m in w.model.named_modules()}
    order = [names[id(b)].split(".")[0] for b in w.blocks]
    assert order == sorted(order, key=["down_blocks", "mid_block", "up_blocks"].index)


def test_missing_library_is_a_workload_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from ckpt_graph.compare.zoo import WorkloadError

    real = importlib.import_module

    def no_diffusers(name: str, *args: Any) -> Any:
        if name == "diffusers":
            raise ImportError("No module named 'diffusers'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_diffusers)
    with pytest.raises(WorkloadError, match=r"--model diffusers-unet needs the 'diffusers'"):
        build_workload("diffusers-unet", **TINY_SIZES["diffusers-unet"])  # type: ignore[arg-type]


def test_mixtral_memory_budget_keeping_everything() -> None:
    from ckpt_graph.policies import memory_budget

    w = _workload("hf-mixtral")
    initial = {k: v.clone() for k, v in w.model.state_dict().items()}
    ref = step_workload(w, initial, None)
    got = step_workload(w, initial, memory_budget(1.0, flops_per_byte=2.0))
    for n, g in ref["grads"].items():
        if g is not None:
            torch.testing.assert_close(got["grads"][n], g, rtol=0, atol=0)


def test_every_zoo_model_default_size_passes_the_cli_memory_check() -> None:
    """The size guard of ``compare`` accepts every model at its own default size (it refused
    hf-vit, estimating 28 GiB for a 70 MiB step, by reading its image side as CNN pixels)."""
    from ckpt_graph.compare import third_party
    from ckpt_graph.compare.zoo import estimate_bytes

    for name, spec in third_party.SPECS.items():
        need = estimate_bytes(name, spec.layers, spec.width, spec.batch, spec.seq_len)
        assert need < 8 * 2**30, f"{name}: {need / 2**30:.1f} GiB estimated"  # CI has 24 GiB
