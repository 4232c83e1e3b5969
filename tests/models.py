"""Shared model zoo and comparison helpers for the ckpt_graph tests.

Everything here is deterministic given a seed and small enough to run in milliseconds on CPU.

The central helper is :func:`run`: it runs a function (or module) once, optionally inside a
``save_recompute_policy`` region, backpropagates fixed pseudo-random output gradients and returns
everything a checkpointed run must reproduce bitwise: outputs, gradients, buffers, the values of
inputs that may have been mutated, and the RNG states after backward.

Example:
    >>> ref, got = run_both(lambda x: x.sin().cos(), [torch.randn(3, requires_grad=True)])
    >>> assert_same(ref, got)
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg
from ckpt_graph.compare.architectures import GPT

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# Running a function with and without checkpointing
# ---------------------------------------------------------------------------------------------

Scope = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass
class Result:
    """What one run produced, for bitwise comparison between eager and checkpointed runs.

    Attributes:
        outputs: every tensor output, detached.
        grads: ``.grad`` of every input, then of every module parameter, then of every output
            that is a leaf requiring grad (a leaf created inside the region).
        buffers: the module's buffers after forward and backward.
        inputs_after: the inputs' values after forward and backward (catches mutations replayed
            twice or never).
        rng_state: ``torch.get_rng_state()`` after backward.
        generator_states: states of the ``torch.Generator`` inputs after backward.
        region: the region object of the checkpointed run (None for eager).
    """

    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    inputs_after: list[torch.Tensor]
    rng_state: torch.Tensor
    generator_states: list[torch.Tensor]
    region: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def flat_tensors(obj: Any) -> list[torch.Tensor]:
    """All tensors in a (nested) tuple/list/dict output, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in flat_tensors(o)]
    return []


def fresh(obj: Any) -> Any:
    """An independent copy of an input: tensors cloned (leaf again), generators and modules copied."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().clone()
        return t.requires_grad_(obj.requires_grad)
    if isinstance(obj, torch.Generator):
        g = torch.Generator(device=obj.device)
        g.set_state(obj.get_state())
        return g
    if isinstance(obj, nn.Module):
        return copy.deepcopy(obj)
    return obj


def grad_outputs(outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fixed pseudo-random output gradients that do not touch the default RNG."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]


def differentiable(outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs to backpropagate from: non-leaf tensors that require grad."""
    return [o for o in outs if o.requires_grad and not o.is_leaf]


def run(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    policy: Any = None,
    *,
    scoped: bool = False,
    seed: int = 0,
    backward: bool = True,
) -> Result:
    """Run ``fn(*inputs)`` once and backpropagate.

    Args:
        fn: a function or an ``nn.Module`` (deep-copied, so both runs start from equal state).
        inputs: tensors (cloned; ``requires_grad`` kept), generators (copied) or other values.
        policy: None for the eager reference run, else the ``save_recompute_policy`` policy.
        scoped: if True, ``fn(scope, *inputs)`` is called and opens the region itself with
            ``with scope():`` (a no-op context in the eager run); lets a test do work outside
            the region (non-leaf region inputs, autocast around the region, two regions).
        seed: ``torch.manual_seed`` applied just before the forward.
        backward: whether to run backward.

    Returns:
        A :class:`Result`.
    """
    fn = fresh(fn) if isinstance(fn, nn.Module) else fn
    ins = [fresh(i) for i in inputs]
    region_box: list[Any] = []

    @contextlib.contextmanager
    def scope() -> Iterator[Any]:
        if policy is None:
            yield None
            return
        with cg.save_recompute_policy(policy) as region:
            region_box.append(region)
            yield region

    torch.manual_seed(seed)
    if scoped:
        out = fn(scope, *ins)
    else:
        with scope():
            out = fn(*ins)
    outs = flat_tensors(out)
    if backward:
        diff = differentiable(outs)
        if diff:
            torch.autograd.backward(diff, grad_outputs(diff))
    grads: list[torch.Tensor | None] = [i.grad for i in ins if isinstance(i, torch.Tensor)]
    buffers: dict[str, torch.Tensor] = {}
    for m in [fn, *ins]:
        if isinstance(m, nn.Module):
            grads += [p.grad for p in m.parameters()]
            buffers.update({k: b.detach().clone() for k, b in m.named_buffers()})
    grads += [o.grad for o in outs if o.is_leaf and o.requires_grad]
    return Result(
        outputs=[o.detach() for o in outs],
        grads=grads,
        buffers=buffers,
        inputs_after=[i.detach().clone() for i in ins if isinstance(i, torch.Tensor)],
        rng_state=torch.get_rng_state(),
        generator_states=[g.get_state() for g in ins if isinstance(g, torch.Generator)],
        region=region_box[0] if region_box else None,
    )


def assert_same(ref: Result, got: Result, *, check_rng: bool = True) -> None:
    """Assert two runs agree bitwise: outputs, grads, buffers, mutated inputs, RNG states."""

    def same(a: Any, b: Any, what: str) -> None:
        torch.testing.assert_close(
            b, a, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}"
        )

    assert len(ref.outputs) == len(got.outputs), "different number of outputs"
    for i, (a, b) in enumerate(zip(ref.outputs, got.outputs, strict=True)):
        same(a, b, f"output {i}")
    assert len(ref.grads) == len(got.grads)
    for i, (ga, gb) in enumerate(zip(ref.grads, got.grads, strict=True)):
        assert (ga is None) == (gb is None), f"grad {i}: {ga} vs {gb}"
        if ga is not None:
            same(ga, gb, f"grad {i}")
    assert ref.buffers.keys() == got.buffers.keys()
    for k in ref.buffers:
        same(ref.buffers[k], got.buffers[k], f"buffer {k}")
    for i, (a, b) in enumerate(zip(ref.inputs_after, got.inputs_after, strict=True)):
        same(a, b, f"input {i} after the run")
    if check_rng:
        assert torch.equal(ref.rng_state, got.rng_state), "default RNG state differs after backward"
        for i, (a, b) in enumerate(zip(ref.generator_states, got.generator_states, strict=True)):
            assert torch.equal(a, b), f"state of generator input {i} differs after backward"


def run_both(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    policy: Any = "recompute_all",
    *,
    scoped: bool = False,
    seed: int = 0,
) -> tuple[Result, Result]:
    """Run ``fn`` without (reference) and with checkpointing; see :func:`run`."""
    ref = run(fn, inputs, None, scoped=scoped, seed=seed)
    got = run(fn, inputs, policy, scoped=scoped, seed=seed)
    return ref, got


def check(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    policy: Any = "recompute_all",
    *,
    scoped: bool = False,
    seed: int = 0,
) -> tuple[Result, Result]:
    """:func:`run_both` then :func:`assert_same`; returns both results for extra checks."""
    ref, got = run_both(fn, inputs, policy, scoped=scoped, seed=seed)
    assert_same(ref, got)
    return ref, got


def leaf(
    *shape: int, dtype: torch.dtype = torch.float64, seed: int = 0, grad: bool = True
) -> torch.Tensor:
    """A reproducible random leaf tensor (does not touch the default RNG)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------

MATMUL_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.convolution.default,
    }
)


def save_matmuls(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul / convolution / attention outputs, recompute everything else."""
    if op in MATMUL_OPS or str(op).startswith("aten._scaled_dot_product"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def const_policy(answer: Any, name: str = "const") -> Callable[..., Any]:
    """A policy answering ``answer`` for every op; ``__name__`` set for error-message checks."""

    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return answer

    policy.__name__ = policy.__qualname__ = name
    return policy


# ---------------------------------------------------------------------------------------------
# Counting custom ops (laziness and recompute-failure tests)
# ---------------------------------------------------------------------------------------------

CALLS: Counter[str] = Counter()
# Weakrefs to the storages of every output the counting ops produced (forward and recompute):
# a storage dies only when no tensor (or alias of it) uses it any more.
LIVE_OUTPUTS: list[weakref.ref[Any]] = []
FRAGILE = {"max_calls": 1}


def _counting_op(
    name: str,
    fn: Callable[[torch.Tensor], torch.Tensor],
    grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    saves_output: bool,
) -> Any:
    """A custom op ``ckpt_graph_test::<name>`` computing ``fn(x)``, counting its calls in
    ``CALLS[name]`` and recording its output's storage in ``LIVE_OUTPUTS``; its backward
    saves its input (or its output when ``saves_output``) and returns ``grad(g, saved)``."""

    @torch.library.custom_op(f"ckpt_graph_test::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        CALLS[name] += 1
        out = fn(x)
        LIVE_OUTPUTS.append(weakref.ref(out.untyped_storage()))
        return out

    @op.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(output if saves_output else inputs[0])

    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (saved,) = ctx.saved_tensors
        return grad(g, saved)

    op.register_autograd(backward, setup_context=setup)
    return op


# sin(x), counting calls; its backward needs its input.
counted = _counting_op("counted", torch.sin, lambda g, x: g * x.cos(), saves_output=False)
# exp(x), counting calls; its backward needs its output.
counted_exp = _counting_op("counted_exp", torch.exp, lambda g, out: g * out, saves_output=True)


def _save_input(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(inputs[0])


@torch.library.custom_op("ckpt_graph_test::counted_pair", mutates_args=())
def counted_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin(x), cos(x)), counting calls; its backward needs its input only."""
    CALLS["counted_pair"] += 1
    s, c = x.sin(), x.cos()
    LIVE_OUTPUTS.extend([weakref.ref(s.untyped_storage()), weakref.ref(c.untyped_storage())])
    return s, c


@counted_pair.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _counted_pair_backward(ctx: Any, gs: torch.Tensor, gc: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return gs * x.cos() - gc * x.sin()


counted_pair.register_autograd(_counted_pair_backward, setup_context=_save_input)


@torch.library.custom_op("ckpt_graph_test::fragile", mutates_args=())
def fragile(x: torch.Tensor) -> torch.Tensor:
    """x * 3, failing once it has been called more than ``FRAGILE["max_calls"]`` times."""
    CALLS["fragile"] += 1
    if CALLS["fragile"] > FRAGILE["max_calls"]:
        raise RuntimeError("fragile op called again")
    return x * 3


@fragile.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _fragile_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    pass


def _fragile_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return grad * 3


fragile.register_autograd(_fragile_backward, setup_context=_fragile_setup)


def reset_counters() -> None:
    """Reset call counts, recorded output weakrefs and the fragile op's budget."""
    CALLS.clear()
    LIVE_OUTPUTS.clear()
    FRAGILE["max_calls"] = 1


# ---------------------------------------------------------------------------------------------
# Model zoo
# ---------------------------------------------------------------------------------------------


class Blocks(nn.Module):
    """Base for zoo models: a stem, a list of blocks, a head.

    Test hooks (unset in reference runs): ``block_policy`` maps a block index to a policy under
    which that block runs (a nested ``save_recompute_policy``); ``tag_blocks`` tags every block
    output with ``MUST_SAVE``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        self.block_policy: dict[int, Any] = {}
        self.tag_blocks = False

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for i, block in enumerate(self.blocks):
            if i in self.block_policy:
                with cg.save_recompute_policy(self.block_policy[i]):
                    h = block(h)
            else:
                h = block(h)
            if self.tag_blocks:
                cg.tag_with_policy(h, True)
        return self.head(h)


class MLP(Blocks):
    """Linear + GELU blocks."""

    def __init__(self, d: int = 8, depth: int = 3, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        for _ in range(depth):
            self.blocks.append(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)))
        self.out = nn.Linear(d, 3)
        self.to(dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h.tanh())


class CNN(Blocks):
    """Conv + BatchNorm2d + ReLU + Dropout blocks, average pool and a linear head."""

    def __init__(
        self, channels: int = 4, depth: int = 2, p: float = 0.25, dtype: torch.dtype = torch.float64
    ) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, channels, 3, padding=1)
        for _ in range(depth):
            self.blocks.append(
                nn.Sequential(
                    nn.Conv2d(channels, channels, 3, padding=1),
                    nn.BatchNorm2d(channels),
                    nn.ReLU(),
                    nn.Dropout(p),
                )
            )
        self.fc = nn.Linear(channels, 5)
        self.to(dtype)

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h.mean(dim=(2, 3)))


class TransformerBlock(nn.Module):
    """Pre-norm block: causal multi-head SDPA and a GELU MLP, with dropout."""

    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)
        )
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer(Blocks):
    """Token embedding + learned positions, transformer blocks, final LayerNorm and a head."""

    def __init__(
        self,
        vocab: int = 11,
        d: int = 8,
        heads: int = 2,
        depth: int = 2,
        seq: int = 6,
        p: float = 0.1,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        for _ in range(depth):
            self.blocks.append(TransformerBlock(d, heads, p))
        self.ln = nn.LayerNorm(d)
        self.lm = nn.Linear(d, vocab)
        self.to(dtype)

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x) + self.pos[: x.shape[1]]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(h))


def make_model(
    name: str, dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[Blocks, torch.Tensor]:
    """A zoo model (in training mode) and a matching input batch, both reproducible."""
    torch.manual_seed(seed)
    model: Blocks
    if name == "mlp":
        model = MLP(dtype=dtype)
        x = torch.randn(4, 8, dtype=dtype, requires_grad=True)
    elif name == "cnn":
        model = CNN(dtype=dtype)
        x = torch.randn(2, 3, 6, 6, dtype=dtype, requires_grad=True)
    elif name == "transformer":
        model = Transformer(dtype=dtype)
        with torch.no_grad():
            model.pos.normal_()
        x = torch.randint(0, 11, (2, 6))
    else:
        raise ValueError(f"unknown zoo model {name!r}")
    return model.train(), x


ZOO = ("mlp", "cnn", "transformer")


class RegionSpy:
    """A policy that records the regions it is asked in (and recomputes everything)."""

    def __init__(self) -> None:
        self.regions: list[Any] = []

    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        if ctx.region not in self.regions:
            self.regions.append(ctx.region)
        return False


def mlp_blocks() -> nn.ModuleList:
    """Six 128 -> 512 -> 128 GELU blocks (seed 0): a small stack the budget tests share."""
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(6)
    )


def blocks_step(blocks: nn.ModuleList, policy: Any, x: torch.Tensor) -> None:
    """One training step of ``blocks`` in sequence, in one region under ``policy`` (or none
    when ``None``), loss ``mean(h ** 2)``; gradients reset first."""
    for p in blocks.parameters():
        p.grad = None
    with cg.save_recompute_policy(policy) if policy is not None else contextlib.nullcontext():
        h = x
        for b in blocks:
            h = b(h)
    h.pow(2).mean().backward()


def gpt_loss_per_block(
    model: GPT, x: torch.Tensor, policy: Any, regions: list[cg.Region] | None = None
) -> torch.Tensor:
    """The loss ``mean(out ** 2)`` of a ``GPT`` without dropout on ``x``, each block in a
    region of its own under ``policy``; the regions are appended to ``regions`` if given."""
    pos = torch.arange(x.shape[1])
    h = model.tok(x) + model.pos(pos)
    for block in model.blocks:
        with cg.save_recompute_policy(policy) as region:
            h = block(h)
        if regions is not None:
            regions.append(region)
    return model.head(model.ln_f(h)).pow(2).mean()  # type: ignore[no-any-return]
