"""``ckpt_graph.checkpoint`` as a drop-in for ``torch.utils.checkpoint``; torch SAC policies.

See Note [checkpoint as a drop-in for torch's], Note [Patching torch's checkpoint] and Note
[torch SAC policies passed as ckpt_graph policies].
"""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import ckpt_graph as cg
from ckpt_graph import policies
from ckpt_graph._errors import CkptGraphError
from ckpt_graph.engine.region import current_region
from ckpt_graph.integrations.torch_routing import installed

aten = torch.ops.aten
_TORCH_INTERNALS = (
    "_checkpoint_without_reentrant_generator",
    "CheckpointFunction",
    "_checkpoint_hook",
)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 16, generator=g, dtype=torch.float64, requires_grad=True)
    return x, w


def _body(x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    h = torch.nn.functional.dropout((x @ w).sin(), p=0.3, training=True)
    return (h @ w).relu() * scale


def _grads(run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    x, w = _inputs()
    torch.manual_seed(5)
    run(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None
    return [x.grad, w.grad]


def _reference() -> list[torch.Tensor]:
    return _grads(lambda x, w: _body(x, w, scale=0.5))


def _sac_keep_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op == aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize(
    "options",
    [
        {"use_reentrant": False},
        {"use_reentrant": True, "preserve_rng_state": False},
        {"determinism_check": "none", "early_stop": False},
        {"debug": True},
    ],
)
def test_torch_keywords_are_not_passed_to_the_function(options: dict[str, Any]) -> None:
    got = _grads(lambda x, w: cg.checkpoint(_body, x, w, scale=0.5, **options))
    for a, b in zip(got, _reference(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_debug_keyword_opens_a_debug_region() -> None:
    x, _ = _inputs()
    seen: list[bool] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        region = current_region()
        assert region is not None
        seen.append(region.debug)
        return x.sin()

    cg.checkpoint(body, x, debug=True)
    cg.checkpoint(body, x)
    assert seen == [True, False]


def test_unknown_determinism_check_raises() -> None:
    x, w = _inputs()
    with pytest.raises(CkptGraphError, match=r"determinism_check='strict'.*'default' or 'none'"):
        cg.checkpoint(_body, x, w, determinism_check="strict")


@pytest.mark.parametrize("sac", [_sac_keep_mm, [aten.mm.default]])
def test_context_fn_from_torch_sac_keeps_what_torch_keeps(sac: Any) -> None:
    context_fn = functools.partial(create_selective_checkpoint_contexts, sac)
    x, w = _inputs()
    with (
        cg.save_recompute_policy("recompute_all") as region,
        cg.save_recompute_policy(policies.from_torch_sac(sac)),
    ):
        _body(x, w)
    with cg.save_recompute_policy("recompute_all") as translated:
        cg.checkpoint(_body, x, w, context_fn=context_fn)
    expected = sum(region.summary().kept_by.values())
    assert sum(translated.summary().kept_by.values()) == expected > 0
    got = _grads(lambda x, w: cg.checkpoint(_body, x, w, scale=0.5, context_fn=context_fn))
    for a, b in zip(got, _reference(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_context_fn_pins_torch_private_policy_attribute() -> None:
    # Note [checkpoint as a drop-in for torch's] reads _CachingTorchDispatchMode.policy_fn.
    forward_ctx, _ = create_selective_checkpoint_contexts(_sac_keep_mm)
    assert isinstance(forward_ctx, torch_checkpoint._CachingTorchDispatchMode)
    assert forward_ctx.policy_fn is _sac_keep_mm


def test_other_context_fn_raises_with_the_fix() -> None:
    x, w = _inputs()

    def contexts() -> tuple[Any, Any]:
        return torch.autograd.graph.save_on_cpu(), torch.autograd.graph.save_on_cpu()

    with pytest.raises(CkptGraphError, match=r"context_fn=.*policies.from_torch_sac\(policy_fn\)"):
        cg.checkpoint(_body, x, w, context_fn=contexts)
    # torch's no-op context is accepted as "no context"
    cg.checkpoint(_body, x, w, context_fn=torch_checkpoint.noop_context_fn)


def test_user_function_keyword_still_reaches_the_function() -> None:
    x, _ = _inputs()
    got = cg.checkpoint(lambda x, *, power: x**power, x, power=3, policy="must_save_all")
    torch.testing.assert_close(got, x**3, rtol=0, atol=0)


def _sequential() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(5):
        layers += [torch.nn.Linear(16, 16).double(), torch.nn.GELU(), torch.nn.Dropout(0.2)]
    return torch.nn.Sequential(*layers)


@pytest.mark.parametrize("segments", [1, 2, 4, 15])
def test_checkpoint_sequential_matches_torch(segments: int) -> None:
    results = []
    for fn in (torch_checkpoint.checkpoint_sequential, cg.checkpoint_sequential):
        model = _sequential()
        x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
        torch.manual_seed(7)
        fn(model, segments, x, use_reentrant=False).sum().backward()
        results.append([x.grad, *(p.grad for p in model.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_sequential_segments_checked() -> None:
    with pytest.raises(CkptGraphError, match=r"segments=0\) needs 1 <= segments <= 15"):
        cg.checkpoint_sequential(_sequential(), 0, torch.randn(2, 16))


def _third_party_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Code written for torch: calls torch.utils.checkpoint.checkpoint by attribute."""
    h = torch.utils.checkpoint.checkpoint(_body, x, w, use_reentrant=False, scale=0.5)
    return torch.utils.checkpoint.checkpoint_sequential(
        [torch.sin, torch.cos], 2, h, use_reentrant=False
    )


def test_patch_torch_checkpoint_opens_regions_and_restores() -> None:
    internals = {n: getattr(torch_checkpoint, n) for n in _TORCH_INTERNALS}
    public = (torch_checkpoint.checkpoint, torch_checkpoint.checkpoint_sequential)
    expected = _grads(_third_party_forward)
    regions: list[cg.Region] = []

    def spy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.region not in regions:
            regions.append(ctx.region)
        return CheckpointPolicy.PREFER_RECOMPUTE

    with cg.patch_torch_checkpoint(policy=spy) as patch:
        assert installed()
        got = _grads(_third_party_forward)
    assert "spy" in repr(patch)
    assert patch.calls == 2
    assert (torch_checkpoint.checkpoint, torch_checkpoint.checkpoint_sequential) == public
    assert {n: getattr(torch_checkpoint, n) for n in _TORCH_INTERNALS} == internals
    assert len(regions) == 2  # the checkpoint call and the first of two sequential segments
    assert [r.opened_by for r in regions] == [
        "patch_torch_checkpoint: _body",
        "patch_torch_checkpoint: checkpoint_sequential.<locals>.run_function.<locals>.forward",
    ]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_patch_torch_checkpoint_restores_on_error_and_nests() -> None:
    with pytest.raises(ValueError, match="boom"), cg.patch_torch_checkpoint():
        raise ValueError("boom")
    assert not installed()
    outer, inner = cg.patch_torch_checkpoint(), cg.patch_torch_checkpoint()
    with outer:
        with inner:
            assert installed()
        assert installed()
    assert not installed()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # out of order: harmless, counted
    assert installed()
    inner.__exit__(None, None, None)
    assert not installed()
    with pytest.raises(CkptGraphError, match="left without being entered"):
        inner.__exit__(None, None, None)
    with outer, pytest.raises(CkptGraphError, match="cannot be entered twice"):
        outer.__enter__()


# --- torch SAC signature passed where a ckpt_graph policy is expected (issue 15, item 5) ---


def _kept_bytes_by(policy: Any) -> dict[str, int]:
    x, w = _inputs()
    with cg.save_recompute_policy(policy) as region:
        _body(x, w)
    return dict(region.summary().kept_by)


def test_sac_signature_policy_is_adapted_with_a_warning() -> None:
    expected = _kept_bytes_by(policies.from_torch_sac(_sac_keep_mm))
    assert sum(expected.values()) > 0
    with pytest.warns(UserWarning, match=r"_sac_keep_mm has torch's selective-checkpoint"):
        got = _kept_bytes_by(_sac_keep_mm)
    assert got == expected
    with pytest.warns(UserWarning, match=r"used as policies.from_torch_sac\(.*<lambda>\)"):
        in_combinator = policies.first_answer(lambda ctx, func, *a, **k: None, "recompute_all")
    assert in_combinator is not None


class _SACObject:
    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return _sac_keep_mm(ctx, op)


class _Holder:
    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return _sac_keep_mm(ctx, op)


@pytest.mark.parametrize(
    "policy",
    [_SACObject(), _Holder().policy, functools.partial(_sac_keep_mm)],
    ids=["object", "method", "partial"],
)
def test_sac_signature_detected_on_other_callables(policy: Any) -> None:
    expected = _kept_bytes_by(policies.from_torch_sac(_sac_keep_mm))
    with pytest.warns(UserWarning, match="torch's selective-checkpoint signature"):
        got = _kept_bytes_by(policy)
    assert sum(got.values()) == sum(expected.values())


def _cg_keep_mm(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return _sac_keep_mm(ctx, op)


def _cg_short(ctx: Any, out: Any, *rest: Any) -> CheckpointPolicy:
    return _sac_keep_mm(ctx, rest[0])


@pytest.mark.parametrize("policy", [_cg_keep_mm, _cg_short, policies.save_matmuls()])
def test_ckpt_graph_signature_is_not_adapted(policy: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = _kept_bytes_by(policy)
    assert sum(kept.values()) > 0


# --- the package namespace (issue 15, item 6) ---


def test_submodules_are_lazy_attributes_without_importing_their_libraries() -> None:
    code = (
        "import sys\n"
        "import ckpt_graph as cg\n"
        "heavy = ('transformers', 'pytorch_lightning', 'lightning', 'accelerate', 'networkx')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "print(cg.grads.FlatGrads.__name__, cg.nn.InPlaceABN.__name__)\n"
        "print(cg.integrations.transformers.enable.__name__, 'transformers' in sys.modules)\n"
        "print(cg.integrations.lightning.__name__, 'pytorch_lightning' in sys.modules)\n"
        "print(all(n in dir(cg) for n in ('grads', 'nn', 'integrations', 'analysis')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert out == [
        "[]",
        "FlatGrads InPlaceABN",
        "enable False",
        "ckpt_graph.integrations.lightning False",
        "True",
    ]


def test_unknown_attribute_still_raises() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        cg.nope  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        cg.integrations.nope  # type: ignore[attr-defined]  # noqa: B018
