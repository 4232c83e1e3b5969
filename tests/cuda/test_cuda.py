"""The CUDA paths: RNG replay (dropout, SDPA kernels with dropout), offload with pinned
buffers, a side stream and events, CUDA memory accounting, autocast bf16, ``wrap`` on
transformers' GPT-2, flat gradients under CUDA-graph capture, InPlaceABN (issue 23, section 2).

Checks that make sense on both devices are parametrized over ``cpu`` and ``cuda``, so the test
code itself runs in CI (which has no GPU); the ``cuda`` cases are marked ``cuda`` and skipped
without a CUDA device. ``benchmarks/gpu_check.py`` runs this file on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_graph as cg
from ckpt_graph import policies
from ckpt_graph.engine import graph
from ckpt_graph.engine.region import Region
from ckpt_graph.memory import measure

aten = torch.ops.aten
HAS_CUDA = torch.cuda.is_available()
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _mlp(device: str, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(64, 256), nn.GELU(), nn.Dropout(dropout), nn.Linear(256, 64)]
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def _rng_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _step(
    model: nn.Module, x: torch.Tensor, policy: Any = None, seed: int = 1
) -> tuple[list[torch.Tensor], torch.Tensor, Region | None]:
    """One step from ``seed``: gradients, the RNG state after backward, the region."""
    torch.manual_seed(seed)
    region = None
    if policy is None:
        loss = model(x).float().pow(2).mean()
    else:
        with cg.save_recompute_policy(policy) as region:
            loss = model(x).float().pow(2).mean()
    loss.backward()
    return _grads(model), _rng_state(x.device.type), region


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _recomputed_random(region: Region) -> list[graph.OpNode]:
    """Random op nodes that backward recomputed (none was kept for lack of a replay)."""
    for n in region.nodes:
        for h in n.outputs:
            assert h is None or h.reason is not graph.RANDOM_WITHOUT_REPLAY, n
    return [n for n in region.nodes if n.info.is_random]


# --------------------------------------------------------------------------- RNG replay


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_replay_is_bitwise(device: str) -> None:
    model = _mlp(device, dropout=0.3)
    x = torch.randn(16, 64, device=device)
    want, rng_want, _ = _step(model, x)
    got, rng_got, region = _step(model, x, "recompute_all")
    _assert_bitwise(got, want)
    assert torch.equal(rng_got, rng_want)  # recompute left the user's stream where it was
    assert region is not None and _recomputed_random(region)
    assert region.summary().recomputed_ops_total > 0


def _sdpa_backends() -> list[Any]:
    from torch.nn.attention import SDPBackend

    return [
        pytest.param(SDPBackend.FLASH_ATTENTION, id="flash", marks=CUDA),
        pytest.param(SDPBackend.EFFICIENT_ATTENTION, id="efficient", marks=CUDA),
    ]


@pytest.mark.parametrize("backend", _sdpa_backends())
def test_sdpa_dropout_replay_is_bitwise(backend: Any) -> None:
    """Flash and memory-efficient attention draw their dropout from a Philox seed and offset
    they return; recomputing them must draw the same mask."""
    from torch.nn.attention import sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.float16, requires_grad=True)
        for _ in range(3)
    )
    proj = nn.Linear(64, 64, device="cuda", dtype=torch.float16)

    def run(policy: Any) -> list[torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        torch.manual_seed(3)
        with sdpa_kernel([backend]):
            if policy is None:
                out = nn.functional.scaled_dot_product_attention(
                    proj(q), k, v, dropout_p=0.3, is_causal=True
                )
                out.float().pow(2).sum().backward()
            else:
                with cg.save_recompute_policy(policy) as region:
                    out = nn.functional.scaled_dot_product_attention(
                        proj(q), k, v, dropout_p=0.3, is_causal=True
                    )
                out.float().pow(2).sum().backward()
                assert any(n.info.is_random for n in _recomputed_random(region))
        grads = [t.grad.clone() for t in (q, k, v)] + _grads(proj)  # type: ignore[union-attr]
        return grads

    want = run(None)
    rng_want = torch.cuda.get_rng_state()
    got = run("recompute_all")
    _assert_bitwise(got, want)
    assert torch.equal(torch.cuda.get_rng_state(), rng_want)


# --------------------------------------------------------------------------- offload


def _wide(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return op is aten.addmm.default


@pytest.mark.parametrize("device", DEVICES)
def test_offload_is_exact_and_keeps_values_in_pinned_host_memory(device: str) -> None:
    model = _mlp(device, dropout=0.1)
    x = torch.randn(32, 64, device=device)
    want, _, _ = _step(model, x)
    torch.manual_seed(1)
    with (
        cg.save_recompute_policy("recompute_all") as region,
        cg.save_recompute_policy(policies.offload(_wide)),
    ):
        loss = model(x).float().pow(2).mean()
    kept = [h for n in region.nodes if n.op is aten.addmm.default for h in n.outputs]
    assert kept and all(h is not None and h.kept for h in kept)
    if device == "cpu":  # already in host memory: kept as it is, nothing copied
        assert all(h.offload_device is None for h in kept if h is not None)
    else:
        off = region.offloader()
        assert all(h.value.device.type == "cpu" and h.value.is_pinned() for h in kept)  # type: ignore[union-attr]
        assert off.copies == len(kept)
    loss.backward()
    _assert_bitwise(_grads(model), want)
    if device == "cuda":
        off = region.offloader()
        assert off.copies == 2 * len(kept)  # each value copied back once
        assert not off.pending  # every prefetched value was read


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_offload_copies_run_on_a_side_stream(device: str) -> None:
    """The copies run on the region's side stream; the compute stream only waits on events,
    so backward gives eager's gradients without any host synchronisation of its own."""
    model = _mlp(device)
    x = torch.randn(512, 64, device=device)
    want, _, _ = _step(model, x)
    torch.manual_seed(1)
    with (
        cg.save_recompute_policy("recompute_all") as region,
        cg.save_recompute_policy(policies.offload(_wide)),
    ):
        loss = model(x).float().pow(2).mean()
    off = region.offloader()
    streams = [c.stream for c in off.copiers.values()]  # type: ignore[attr-defined]
    assert len(streams) == 1 and streams[0] != torch.cuda.current_stream()
    loss.backward()
    _assert_bitwise(_grads(model), want)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_measure_matches_max_memory_allocated(device: str) -> None:
    model = _mlp(device)
    x = torch.randn(256, 64, device=device)

    def step(policy: Any) -> None:
        if policy is None:
            loss = model(x).pow(2).mean()
        else:
            with cg.save_recompute_policy(policy):
                loss = model(x).pow(2).mean()
        loss.backward()

    for policy in (None, "recompute_all"):
        step(policy)  # warm: gradients allocated, kernels loaded
        report = measure(step, policy, device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step(policy)
        torch.cuda.synchronize()
        assert report.peak_bytes == torch.cuda.max_memory_allocated() - start
    eager = measure(step, None, device=device).peak_bytes
    region = measure(step, "recompute_all", device=device).peak_bytes
    assert region < eager
    one = measure(lambda: torch.empty(1 << 20, dtype=torch.uint8, device=device), device=device)
    assert one.peak_bytes == 1 << 20


# --------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bf16_is_bitwise(device: str) -> None:
    model = _mlp(device, dropout=0.1)
    x = torch.randn(16, 64, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        want, _, _ = _step(model, x)
        got, _, region = _step(model, x, policies.save_matmuls())
    _assert_bitwise(got, want)
    assert region is not None
    assert any(h.dtype == torch.bfloat16 for n in region.nodes for h in n.outputs if h is not None)


# --------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("device", DEVICES)
def test_wrap_hf_gpt2_is_bitwise(device: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128, attn_implementation="sdpa"
    )
    model = transformers.GPT2LMHeadModel(cfg).to(device).train()  # dropout 0.1 everywhere
    ids = torch.randint(0, 128, (2, 32), device=device)

    def step() -> list[torch.Tensor]:
        torch.manual_seed(5)
        model(input_ids=ids, labels=ids).loss.backward()
        return _grads(model)

    want = step()
    cg.wrap(model)
    try:
        got = step()
    finally:
        cg.unwrap(model)
    _assert_bitwise(got, want)


# --------------------------------------------------------------------------- flat grads


def _flat_setup(device: str) -> tuple[nn.Module, Any, torch.Tensor]:
    from ckpt_graph.grads import FlatGrads

    model = _mlp(device)
    flat = FlatGrads(model)
    x = torch.randn(32, 64, device=device)
    return model, flat, x


@pytest.mark.parametrize("device", DEVICES)
def test_flat_grads_stay_in_place_across_steps(device: str) -> None:
    model, flat, x = _flat_setup(device)
    buf = flat.buffer(torch.device(device), torch.float32)
    ptr = buf.data_ptr()
    ref = _mlp(device)
    for _ in range(2):
        flat.zero_()
        with cg.save_recompute_policy("recompute_all"):
            loss = model(x).pow(2).mean()
        loss.backward()
        ref.zero_grad(set_to_none=True)
        ref(x).pow(2).mean().backward()
        assert flat.buffer(torch.device(device), torch.float32).data_ptr() == ptr
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and p.grad.data_ptr() >= ptr
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_flat_grads_under_cuda_graph_capture_and_replay(device: str) -> None:
    """A whole training step captured in a CUDA graph writes its gradients into the flat
    buffer, at the same address at every replay, equal to eager's."""
    model, flat, x = _flat_setup(device)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch's recipe asks
        for _ in range(3):
            flat.zero_()
            model(static_x).pow(2).mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    ptr = flat.buffer(torch.device(device), torch.float32).data_ptr()
    g = torch.cuda.CUDAGraph()
    flat.zero_()
    with torch.cuda.graph(g):
        model(static_x).pow(2).mean().backward()
    ref = _mlp(device)
    for step in range(3):
        new_x = torch.randn_like(x) + step
        static_x.copy_(new_x)
        flat.zero_()
        g.replay()
        torch.cuda.synchronize()
        ref.zero_grad(set_to_none=True)
        ref(new_x).pow(2).mean().backward()
        assert flat.buffer(torch.device(device), torch.float32).data_ptr() == ptr
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- InPlaceABN


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_abn_matches_batch_norm_and_activation(device: str) -> None:
    from ckpt_graph.nn import InPlaceABN

    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8, device=device, dtype=torch.float64)
    abn = InPlaceABN(8, activation="leaky_relu", activation_param=0.1, device=device)
    abn = abn.to(torch.float64)
    abn.load_state_dict(bn.state_dict())
    x = torch.randn(4, 8, 16, 16, device=device, dtype=torch.float64, requires_grad=True)
    grad = torch.randn_like(x)

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        x.grad = None
        out = fn(x * 1.0)
        value = out.detach().clone()
        out.backward(grad)
        assert x.grad is not None
        return [value, x.grad.clone()]

    want = run(lambda t: nn.functional.leaky_relu(bn(t), 0.1))
    got = run(abn)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(abn.parameters(), bn.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(abn.running_mean, bn.running_mean, rtol=1e-12, atol=1e-12)
