"""Embedded workloads for ``ckpt-graph compare``: small models built with random weights.

Every workload is a :class:`Workload`: a model whose repeated *blocks* are listed so that a
strategy can checkpoint them one by one (or in groups), a batch of inputs and a loss. The
models are those of ``architectures`` or, for ``hf-gpt2`` / ``hf-llama`` and the models of
``third_party`` (:data:`THIRD_PARTY`), ones from libraries installed from the package index.
Nothing is downloaded: those are built from a config with random weights.

Example:
    >>> from ckpt_graph.compare.zoo import build_workload
    >>> w = build_workload("gpt", layers=2, width=32, batch=2, seq_len=8)
    >>> loss = w.loss(w.model(*w.inputs))
    >>> loss.backward()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.compare import beyond_zoo, third_party
from ckpt_graph.compare.architectures import GPT, ConvNet, ResidualMLP

# Models of other libraries (transformers, diffusers, torch.nn layers): the benchmark zoo.
THIRD_PARTY: tuple[str, ...] = tuple(third_party.SPECS)
# Models beyond the zoo (``beyond_zoo``): built like the zoo's, outside its benchmark.
EXTRA: tuple[str, ...] = tuple(beyond_zoo.SPECS)
MODELS = ("gpt", "mlp", "cnn", "hf-gpt2", "hf-llama", *THIRD_PARTY, *EXTRA)


class WorkloadError(CkptGraphValueError):
    """A workload cannot be built from the given sizes (bad size, missing package).

    A ``ValueError`` and a ``CkptGraphError``; the CLI prints its message after its own
    prefix. See Note [Error types].
    """


@dataclass(frozen=True)
class ModelDefaults:
    """Default sizes of one model; the CLI's ``--layers`` etc. override them."""

    layers: int
    width: int
    batch: int
    seq_len: int


# Note [Default workload size]
# The default `compare` run (8 strategies; per strategy a warm-up, a step under the memory
# profiler, a step under the op counter and 3 timed steps) must finish in under 60 s on 2 CPU
# cores in float32, with room for a slower or shared machine (timings in BENCHMARKS.md,
# "History from Notes"). Activations (batch x seq x width x 8 layers) outweigh the
# parameters so that checkpointing visibly changes peak memory. See Note [One thread by default].
DEFAULTS: dict[str, ModelDefaults] = {
    "gpt": ModelDefaults(layers=8, width=256, batch=4, seq_len=128),
    "mlp": ModelDefaults(layers=8, width=256, batch=512, seq_len=1),
    "cnn": ModelDefaults(layers=6, width=32, batch=16, seq_len=64),
    "hf-gpt2": ModelDefaults(layers=4, width=256, batch=4, seq_len=128),
    "hf-llama": ModelDefaults(layers=4, width=256, batch=4, seq_len=128),
    # See Note [Third-party zoo sizes].
    **{
        n: ModelDefaults(s.layers, s.width, s.batch, s.seq_len)
        for n, s in (third_party.SPECS | beyond_zoo.SPECS).items()
    },
}

# Third-party models at the smallest sizes that keep each architecture whole (images must survive every
# downsampling): the sizes of the tests and of benchmarks/bench_sim_error.py.
TINY_SIZES: dict[str, dict[str, int]] = {
    "hf-gpt2": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-llama": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-bert": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-t5": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-mixtral": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-vit": dict(layers=2, width=32, batch=2, seq_len=16),
    "hf-swin": dict(layers=2, width=16, batch=1, seq_len=64),
    "hf-convnext": dict(layers=2, width=8, batch=2, seq_len=32),
    "hf-mobilenetv2": dict(layers=16, width=8, batch=2, seq_len=32),
    "hf-efficientnet": dict(layers=10, width=8, batch=2, seq_len=32),
    "hf-resnet": dict(layers=4, width=8, batch=2, seq_len=32),
    "diffusers-unet": dict(layers=1, width=8, batch=2, seq_len=16),
    "torch-loop": dict(layers=2, width=32, batch=2, seq_len=8),
}


@dataclass(frozen=True)
class Workload:
    """A model, its repeated blocks, one batch and a loss.

    Attributes:
        name: model name (one of :data:`MODELS`).
        model: the module; ``model(*inputs)`` returns the output fed to ``loss``.
        blocks: the repeated blocks, in forward order, each called once per forward.
        inputs: the batch (on the model's device).
        loss_fn: maps the model output to a scalar loss.
        blocks_are_plain: every block maps one tensor to one tensor (``h = block(h)``).
            torch-sqrt does not rely on it: it reads which blocks chain from one forward
            (see Note [Block chains]).
        sizes: the sizes the workload was built with.
    """

    name: str
    model: nn.Module
    blocks: Sequence[nn.Module]
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[object], torch.Tensor]
    blocks_are_plain: bool
    sizes: dict[str, int] = field(default_factory=dict)

    def loss(self, output: object) -> torch.Tensor:
        """Scalar loss of one model output."""
        return self.loss_fn(output)


def _check_sizes(layers: int, width: int, batch: int, seq_len: int) -> None:
    for name, value in (("layers", layers), ("width", width), ("batch", batch)):
        if value < 1:
            raise WorkloadError(f"--{name} must be a positive integer, got {value}")
    if seq_len < 1:
        raise WorkloadError(f"--seq-len must be a positive integer, got {seq_len}")


def _heads(width: int) -> int:
    """Number of attention heads: head size 64 where possible, at least one head."""
    heads = max(1, width // 64)
    while width % heads:
        heads -= 1
    return heads


def estimate_bytes(name: str, layers: int, width: int, batch: int, seq_len: int) -> int:
    """Rough upper estimate of one training step's memory without checkpointing, in bytes (fp32).

    Used to reject sizes that cannot fit before building anything.
    """
    if name in third_party.SPECS:
        return third_party.estimate_bytes(name, layers, width, batch, seq_len)
    if name in beyond_zoo.SPECS:
        return beyond_zoo.estimate_bytes(name, layers, width, batch, seq_len)
    if name == "mlp":
        params = layers * 8 * width * width
        acts = layers * batch * width * 12
    elif name == "cnn":
        params = layers * 18 * width * width
        acts = layers * batch * width * seq_len * seq_len * 10
    else:
        vocab = 1024 if name == "gpt" else 2048
        params = layers * 12 * width * width + 2 * vocab * width
        acts = layers * batch * seq_len * width * 24 + 3 * batch * seq_len * vocab
    return 4 * (3 * params + acts)


def build_workload(
    name: str,
    *,
    layers: int | None = None,
    width: int | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    dropout: float = 0.0,
    seed: int = 0,
    heads: int | None = None,
    eager_attention: bool = False,
) -> Workload:
    """Build one embedded workload with random weights and a random batch.

    Args:
        name: one of :data:`MODELS`.
        layers, width, batch, seq_len: sizes; ``None`` takes :data:`DEFAULTS`. For ``cnn``,
            ``seq_len`` is the image side; for ``mlp`` it is ignored.
        dtype, device: where the model and batch live.
        dropout: dropout probability (GPT-style models only).
        seed: seed for weights and batch.
        heads: attention heads of ``gpt`` and ``hf-gpt2`` (``None``: head size 64 where
            possible); must divide ``width``.
        eager_attention: ``gpt`` computes attention op by op (softmax of the T x T scores,
            dropout on the probabilities) instead of one fused op; ``hf-gpt2`` uses
            transformers' ``"eager"`` attention instead of ``"sdpa"``.

    Raises:
        WorkloadError: unknown model, nonsensical size, or the model's library missing.

    Example:
        >>> w = build_workload("mlp", layers=2, width=16, batch=4)
        >>> len(w.blocks)
        2
    """
    if name not in DEFAULTS:
        raise WorkloadError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    d = DEFAULTS[name]
    layers = d.layers if layers is None else layers
    width = d.width if width is None else width
    batch = d.batch if batch is None else batch
    seq_len = d.seq_len if seq_len is None else seq_len
    _check_sizes(layers, width, batch, seq_len)
    if not 0.0 <= dropout < 1.0:
        raise WorkloadError(f"--dropout must be in [0, 1), got {dropout}")
    sizes = {"layers": layers, "width": width, "batch": batch, "seq_len": seq_len}
    gen = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if name == "gpt":
        vocab = 1024
        if heads is None:
            heads = _heads(width)
        if heads < 1 or width % heads:
            raise WorkloadError(f"heads must divide width {width}, got {heads}")
        model: nn.Module = GPT(vocab, width, layers, heads, seq_len, dropout, eager_attention)
        idx = torch.randint(0, vocab, (batch, seq_len), generator=gen)
        tgt = torch.randint(0, vocab, (batch, seq_len), generator=gen)
        model = model.to(device=device, dtype=dtype)
        inputs: tuple[torch.Tensor, ...] = (idx.to(device),)
        target = tgt.to(device)
        blocks: Sequence[nn.Module] = list(model.blocks)  # type: ignore[arg-type]

        def gpt_loss(out: object) -> torch.Tensor:
            assert isinstance(out, torch.Tensor)
            return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())

        return Workload(name, model, blocks, inputs, gpt_loss, True, sizes)
    if name in ("mlp", "cnn"):
        if name == "mlp":
            model = ResidualMLP(width, layers)
            x = torch.randn(batch, width, generator=gen)
        else:
            model = ConvNet(width, layers)
            x = torch.randn(batch, 3, seq_len, seq_len, generator=gen)
        model = model.to(device=device, dtype=dtype)
        y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        return Workload(
            name,
            model,
            list(model.blocks),  # type: ignore[arg-type]
            (x.to(device=device, dtype=dtype),),
            _ce_loss(y),
            True,
            sizes,  # type: ignore[arg-type]
        )
    if name in third_party.SPECS or name in beyond_zoo.SPECS:
        source = third_party if name in third_party.SPECS else beyond_zoo
        try:
            built = source.build(name, sizes, dropout, gen)
        except third_party.MissingLibrary as e:
            raise WorkloadError(str(e).removeprefix("ckpt_graph: ")) from None
        model = built.model
        first = next(model.parameters())
        if first.dtype != dtype or first.device != torch.device(device):
            model = model.to(device=device, dtype=dtype)  # (diffusers warns on any cast)
        inputs = tuple(
            x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)
            for x in built.inputs
        )
        # Third-party blocks take keyword arguments and may return tuples: not plain blocks.
        return Workload(name, model, built.blocks, inputs, built.loss_fn, False, sizes)
    if heads is not None and (heads < 1 or width % heads):
        raise WorkloadError(f"heads must divide width {width}, got {heads}")
    return _build_hf(name, sizes, dtype, device, dropout, gen, heads, eager_attention)


def _ce_loss(target: torch.Tensor) -> Callable[[object], torch.Tensor]:
    def loss(out: object) -> torch.Tensor:
        assert isinstance(out, torch.Tensor)
        return F.cross_entropy(out.float(), target)

    return loss


def _build_hf(
    name: str,
    sizes: dict[str, int],
    dtype: torch.dtype,
    device: str | torch.device,
    dropout: float,
    gen: torch.Generator,
    heads: int | None = None,
    eager_attention: bool = False,
) -> Workload:
    try:
        import transformers as _transformers
    except ImportError:
        raise WorkloadError(
            f"--model {name} needs the 'transformers' package (pip install transformers); "
            "the embedded models gpt, mlp and cnn need nothing"
        ) from None
    layers, width, batch, seq_len = (sizes[k] for k in ("layers", "width", "batch", "seq_len"))
    transformers: Any = _transformers  # its stubs vary by version; only public names are used
    heads = _heads(width) if heads is None else heads
    vocab = 2048
    cfg: Any
    model: nn.Module
    if name == "hf-gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=max(seq_len, 8),
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg._attn_implementation = "eager" if eager_attention else "sdpa"
        model = transformers.GPT2LMHeadModel(cfg)
        blocks = list(cast(Any, model).transformer.h)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=width,
            intermediate_size=int(math.ceil(width * 8 / 3 / 32) * 32),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=max(seq_len, 8),
            attention_dropout=dropout,
            use_cache=False,
        )
        cfg._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(cfg)
        blocks = list(cast(Any, model).model.layers)
    model = model.to(device=device, dtype=dtype)
    idx = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)

    def hf_loss(out: object) -> torch.Tensor:
        logits = out.logits  # type: ignore[attr-defined]
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())

    # HF decoder layers take keyword arguments and may return tuples: not plain blocks.
    return Workload(name, model, blocks, (idx,), hf_loss, False, sizes)
