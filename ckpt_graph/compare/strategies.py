"""The strategies of ``ckpt-graph compare``: how each one runs a workload's forward.

Example:
    >>> from ckpt_graph.compare.strategies import make_forward
    >>> from ckpt_graph.compare.zoo import build_workload
    >>> w = build_workload("mlp", layers=2, width=16, batch=4)
    >>> loss = w.loss_fn(make_forward("torch-ckpt", w)())
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.compare.groups import chain_groups, first_tensor, group_forwards
from ckpt_graph.compare.zoo import Workload
from ckpt_graph.engine.decisions import normalize_policy

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "Forward",
    "StrategySkipped",
    "make_forward",
    "policy_note",
    "settling",
]

aten = torch.ops.aten

# (name, description) in display order; DEFAULT_STRATEGIES is all of them.
STRATEGIES: dict[str, str] = {
    "none": "no checkpointing",
    "torch-ckpt": "torch.utils.checkpoint (non-reentrant) per block",
    "torch-sac": "torch selective checkpointing per block, saving matmuls",
    "torch-sqrt": "torch.utils.checkpoint over groups of k=sqrt(N) consecutive blocks",
    "cg-block": "ckpt_graph region per block, recompute_all",
    "cg-sqrt": "ckpt_graph one region, every k=sqrt(N)-th block output kept",
    "cg-matmuls": "ckpt_graph one region, policies.save_matmuls()",
    "cg-budget": "ckpt_graph one region, policies.memory_budget(--budget, default 0.5)",
    "cg-policy": "ckpt_graph one region, the built-in policy named by --policy",
}
# cg-policy runs only when asked for (``--policy NAME`` adds it).
DEFAULT_STRATEGIES: tuple[str, ...] = tuple(s for s in STRATEGIES if s != "cg-policy")

DEFAULT_BUDGET = 0.5

# Ops kept by the torch-sac strategy: the families of ckpt_graph.policies.save_matmuls
# (matmuls, convolutions, fused attention) so that torch-sac and cg-matmuls keep the same values
# and differ only in how they recompute the rest.


@functools.cache
def _matmul_ops() -> frozenset[object]:
    from ckpt_graph.policies import save_matmuls

    return frozenset(save_matmuls().ops)


class StrategySkipped(Exception):
    """A strategy cannot run here (missing module or unsupported model); the message says why."""


# A strategy maps a workload to a function running one forward under that strategy.
Forward = Callable[[], object]


@contextlib.contextmanager
def _patched_forwards(
    blocks: Sequence[torch.nn.Module],
    wrap: Callable[[int, Callable[..., Any]], Callable[..., Any] | None],
) -> Iterator[None]:
    # Note [Patching block forwards]
    # Strategies act on the model's own blocks by shadowing each block's bound `forward` with an
    # instance attribute for the duration of one forward. Parameter names, hooks and weights stay
    # untouched, so every strategy runs the very same modules, and HF layers (keyword arguments,
    # tuple outputs) work too. `wrap(i, orig)` returns the new forward, or None to keep it.
    patched = []
    try:
        for i, block in enumerate(blocks):
            new = wrap(i, block.forward)
            if new is not None:
                block.forward = new  # type: ignore[method-assign]
                patched.append(block)
        yield
    finally:
        for block in patched:
            del block.forward


def _core() -> Any:
    import ckpt_graph as cg

    if not all(hasattr(cg, n) for n in ("save_recompute_policy", "tag_with_policy")):
        raise StrategySkipped("ckpt_graph core (save_recompute_policy) not importable")
    return cg


def _policy(factory: str, *args: object) -> object:
    try:
        from ckpt_graph import policies
    except ImportError:
        raise StrategySkipped("ckpt_graph.policies not importable") from None
    fn = getattr(policies, factory, None)
    if fn is None:
        raise StrategySkipped(f"ckpt_graph.policies.{factory} does not exist yet")
    return fn(*args)


def _sqrt_k(n: int) -> int:
    return max(1, round(math.sqrt(n)))


def _packet(op: object) -> object:
    return getattr(op, "_overloadpacket", op)


def _sac_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE
        if _packet(op) in _matmul_ops()
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


def make_forward(
    name: str,
    w: Workload,
    *,
    budget: float | int = DEFAULT_BUDGET,
    policy_name: str = "save_matmuls",
) -> Forward:
    """Return a function running one forward of ``w`` under strategy ``name``.

    ``budget`` is the memory_budget of cg-budget: a fraction of the activation memory
    without checkpointing, or bytes. ``policy_name`` is
    cg-policy's policy, a name ``save_recompute_policy`` accepts (see Note [Policy names]).

    Raises:
        StrategySkipped: the strategy needs something missing here.
        ValueError: unknown strategy.
    """
    model, blocks, inputs = w.model, w.blocks, w.inputs

    def plain() -> object:
        return model(*inputs)

    def per_block(wrap: Callable[[int, Callable[..., Any]], Callable[..., Any] | None]) -> Forward:
        def forward() -> object:
            with _patched_forwards(blocks, wrap):
                return model(*inputs)

        return forward

    if name == "none":
        return plain
    if name == "torch-ckpt":
        return per_block(lambda i, f: functools.partial(checkpoint, f, use_reentrant=False))
    if name == "torch-sac":
        ctx_fn = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
        return per_block(
            lambda i, f: functools.partial(checkpoint, f, use_reentrant=False, context_fn=ctx_fn)
        )
    if name == "torch-sqrt":
        # Groups of consecutive blocks that chain directly; see Note [Block chains].
        groups = chain_groups(model, blocks, inputs, _sqrt_k(len(blocks)))
        return per_block(
            group_forwards(blocks, groups, functools.partial(checkpoint, use_reentrant=False))
        )
    if name == "cg-block":
        cg = _core()

        def region_wrap(i: int, f: Callable[..., Any]) -> Callable[..., Any]:
            def fwd(*args: object, **kwargs: object) -> object:
                with cg.save_recompute_policy(policy="recompute_all"):
                    return f(*args, **kwargs)

            return fwd

        return per_block(region_wrap)
    if name in ("cg-sqrt", "cg-matmuls", "cg-budget", "cg-policy"):
        cg = _core()
        k = 0
        policy: object = "recompute_all"
        if name == "cg-sqrt":
            k = _sqrt_k(len(blocks))
        elif name == "cg-matmuls":
            policy = _policy("save_matmuls")
        elif name == "cg-budget":
            policy = _policy("memory_budget", budget)
        elif name == "cg-policy":
            policy = normalize_policy(policy_name)  # the API's names: Note [Policy names]

        def tag_wrap(i: int, f: Callable[..., Any]) -> Callable[..., Any] | None:
            # Keep every k-th block output and the last one: torch-sqrt's segment inputs,
            # plus the input of the head, which torch-sqrt leaves outside its checkpoints.
            if k == 0 or ((i + 1) % k and i + 1 != len(blocks)):
                return None

            def fwd(*args: object, **kwargs: object) -> object:
                out = f(*args, **kwargs)
                h = first_tensor(out)
                if h is not None:
                    cg.tag_with_policy(h, True)
                return out

            return fwd

        def one_region() -> object:
            with _patched_forwards(blocks, tag_wrap), cg.save_recompute_policy(policy=policy):
                out = model(*inputs)
                if k:  # the head's output too, as torch-sqrt keeps it (same segmentation)
                    h = first_tensor(out)
                    if h is not None:
                        cg.tag_with_policy(h, True)
                return out

        _POLICIES[one_region] = policy
        return one_region
    raise CkptGraphValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")


# The policy object behind a one-region forward, for its report (e.g. memory_budget's plan).
_POLICIES: weakref.WeakKeyDictionary[Callable[[], object], object] = weakref.WeakKeyDictionary()


def settling(forward: Forward) -> bool:
    """Whether the policy behind ``forward`` still wants steps before it is measured or
    timed (``memory_budget``'s measured check: See Note [Measured budget check])."""
    return bool(getattr(_POLICIES.get(forward), "checking", False))


def policy_note(forward: Forward) -> str:
    """The first line of the report of the policy behind a one-region ``forward`` (e.g.
    ``memory_budget``'s plan), or "" when it has none."""
    report = getattr(_POLICIES.get(forward), "report", None)
    if not callable(report):
        return ""
    summary = report()
    return "" if summary is None else str(summary).splitlines()[0]
