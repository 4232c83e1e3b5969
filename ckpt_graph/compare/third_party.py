"""Workloads nobody on the project wrote: models of libraries installed from the package index.

``transformers`` (GPT-2 and Llama are in ``zoo``; BERT, T5, Mixtral, ViT, Swin, ConvNeXt,
MobileNetV2, EfficientNet, ResNet), ``diffusers`` (UNet2DModel) and plain PyTorch layers
(``nn.TransformerEncoderLayer``) called in a Python loop without a parent module. Each is built
from a small config with random weights (nothing is downloaded); :func:`build` returns the
model, its blocks, a batch and a loss, which ``zoo.build_workload`` wraps into a ``Workload``.

Example:
    >>> from ckpt_graph.compare.zoo import build_workload
    >>> w = build_workload("hf-resnet", layers=4, width=8, batch=2, seq_len=32)
    >>> len(w.blocks)
    4
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_graph._errors import CkptGraphImportError

__all__ = [
    "SPECS",
    "Built",
    "MissingLibrary",
    "Spec",
    "build",
    "estimate_bytes",
    "heads_for",
    "images",
    "in_call_order",
    "load_library",
    "rough_bytes",
    "token_task",
    "tokens_loss",
]

# Note [Third-party zoo sizes]
# The zoo is the benchmark of "models nobody tuned for" (benchmarks/bench_zoo.py), so each entry
# is the library's own model class built from its config, with only sizes changed. Defaults
# are chosen so that one training step without checkpointing takes 40-250 ms of CPU time on
# one thread (per-model timings in BENCHMARKS.md, "History from Notes"), so that a dozen
# configurations with planning fit a few minutes per model, yet ops are not tiny: the text
# models multiply 512 tokens x 256 by 256 x 256 weights and larger, the image models convolve
# 8-16 images of 64 x 64 to 128 x 128 pixels with 16-256 channels.
# Activations outweigh parameters and their gradients (otherwise no checkpointing changes the
# step's peak): torch.utils.checkpoint per block lowers the step peak by 1.5-2.3x on all but
# ResNet (1.3x: its memory sits in the stem and first stage at full resolution). What each
# size means differs by family and is spelt out in each ``Spec.sizes``; fixed-architecture
# CNNs (MobileNetV2, EfficientNet) ignore ``layers``.


@dataclass(frozen=True)
class Spec:
    """One third-party model: its library, default sizes and what the sizes mean.

    Attributes:
        library: the package that defines the model (needed to build it).
        about: one line: the model class and its config.
        layers, width, batch, seq_len: default sizes (``--layers`` etc. override them).
        sizes: what ``layers``, ``width`` and ``seq_len`` mean for this model.
    """

    library: str
    about: str
    layers: int
    width: int
    batch: int
    seq_len: int
    sizes: str


class Built(NamedTuple):
    """What a builder returns: ``loss_fn(model(*inputs))`` is one step's loss."""

    model: nn.Module
    blocks: list[nn.Module]
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[object], torch.Tensor]


class MissingLibrary(CkptGraphImportError):
    """The library a model needs is not installed; the message says which.

    ``zoo.build_workload`` re-raises it as a ``WorkloadError`` without the ``"ckpt_graph: "``
    prefix, as the CLI prints it after its own. See Note [Error types].
    """


_TEXT = "layers: blocks; width: hidden size (head size 64, MLP 4x); seq_len: tokens"
_IMAGE = "seq_len: image side"
SPECS: dict[str, Spec] = {
    "hf-bert": Spec("transformers", "BertForMaskedLM", 4, 256, 4, 128, _TEXT),
    "hf-t5": Spec(
        "transformers",
        "T5ForConditionalGeneration (encoder and decoder)",
        3,
        256,
        4,
        128,
        "layers: encoder blocks (as many decoder blocks); width: d_model (head size 64, "
        "d_ff 4x); seq_len: encoder tokens (decoder: half)",
    ),
    "hf-mixtral": Spec(
        "transformers",
        "MixtralForCausalLM, 4 experts, top-2 routing",
        4,
        256,
        4,
        128,
        "layers: blocks; width: hidden size (head size 64, expert MLP 2x); seq_len: tokens",
    ),
    "hf-vit": Spec(
        "transformers",
        "ViTForImageClassification, 4 x 4 patches",
        4,
        256,
        4,
        64,
        f"layers: blocks; width: hidden size (head size 64, MLP 4x); {_IMAGE}",
    ),
    "hf-swin": Spec(
        "transformers",
        "SwinForImageClassification, 4 x 4 patches, window 4, stage depths (2, 2, layers)",
        2,
        32,
        8,
        64,
        f"layers: blocks of the last stage; width: embedding size (head size 16); {_IMAGE}",
    ),
    "hf-convnext": Spec(
        "transformers",
        "ConvNextForImageClassification, stage depths (L/2, L/2, L, L/2)",
        4,
        32,
        16,
        64,
        f"layers: L; width: channels of the first stage (then 2x, 4x, 8x); {_IMAGE}",
    ),
    "hf-mobilenetv2": Spec(
        "transformers",
        "MobileNetV2ForImageClassification (depthwise convolutions, BatchNorm, ReLU6)",
        16,
        16,
        8,
        96,
        f"layers: ignored (16 blocks); width: 32 x depth multiplier; {_IMAGE}",
    ),
    "hf-efficientnet": Spec(
        "transformers",
        "EfficientNetForImageClassification (depthwise, squeeze-excite), depth coefficient 0.5",
        10,
        16,
        8,
        64,
        f"layers: ignored; width: 32 x width coefficient; {_IMAGE}",
    ),
    "hf-resnet": Spec(
        "transformers",
        "ResNetForImageClassification, basic blocks with BatchNorm, 4 stages",
        8,
        16,
        8,
        128,
        f"layers: blocks (L/4 per stage); width: channels of the first stage; {_IMAGE}",
    ),
    "diffusers-unet": Spec(
        "diffusers",
        "UNet2DModel, 3 levels (attention at the second), noise-prediction MSE loss",
        1,
        32,
        8,
        32,
        f"layers: resnets per level; width: channels of the first level (then 2x, 2x); {_IMAGE}",
    ),
    "torch-loop": Spec(
        "torch",
        "nn.TransformerEncoderLayer (pre-norm) x L called in a Python loop, linear head",
        8,
        256,
        4,
        128,
        _TEXT,
    ),
}


def estimate_bytes(name: str, layers: int, width: int, batch: int, seq_len: int) -> int:
    """Rough upper estimate of one step's memory without checkpointing, in bytes (fp32)."""
    if name == "hf-vit":  # a transformer over 4 x 4 patches: its tokens are the patches
        return rough_bytes(layers, width, batch, (seq_len // 4) ** 2, image=False)
    return rough_bytes(layers, width, batch, seq_len, SPECS[name].sizes.endswith(_IMAGE))


def rough_bytes(layers: int, width: int, batch: int, seq_len: int, image: bool) -> int:
    """Rough upper estimate of one step's memory, in bytes (fp32), of a text model (``seq_len``
    tokens) or, with ``image``, of an image model (``seq_len`` x ``seq_len`` pixels)."""
    if image:  # activations: per image, channels x pixels x ops
        params = 64 * max(layers, 8) * (8 * width) ** 2
        acts = 64 * batch * width * seq_len * seq_len * max(layers, 4)
        return 4 * (3 * params + acts)
    params = 12 * layers * width * width * 4 + 2048 * width
    acts = 48 * layers * batch * seq_len * width + 3 * batch * seq_len * 2048
    return 4 * (3 * params + acts)


def build(
    name: str,
    sizes: dict[str, int],
    dropout: float,
    gen: torch.Generator,
) -> Built:
    """Build a model of :data:`SPECS` (random weights from the global RNG; batch from ``gen``).

    Raises:
        MissingLibrary: the model's library is not installed.
    """
    lib = load_library(name, SPECS[name])
    layers, width, batch, seq_len = (sizes[k] for k in ("layers", "width", "batch", "seq_len"))
    builder = _BUILDERS[name]
    return builder(lib, layers, width, batch, seq_len, dropout, gen)


def load_library(name: str, spec: Spec) -> Any:
    """The module of ``spec.library`` (``torch`` itself for plain PyTorch models).

    Raises:
        MissingLibrary: the library is not installed; the message names model ``name``.
    """
    if spec.library == "torch":
        return torch
    try:
        return importlib.import_module(spec.library)
    except ImportError:
        raise MissingLibrary(
            f"ckpt_graph: --model {name} needs the {spec.library!r} package (pip install "
            f"{spec.library}); the embedded models gpt, mlp and cnn need nothing"
        ) from None


def heads_for(width: int, head_size: int = 64) -> int:
    """Attention heads for ``width``: about ``head_size`` per head, dividing it, at least one."""
    heads = max(1, width // head_size)
    while width % heads:
        heads -= 1
    return heads


def tokens_loss(target: torch.Tensor) -> Callable[[object], torch.Tensor]:
    """Cross-entropy of an output's ``logits`` (classes last) against ``target``."""

    def loss(out: object) -> torch.Tensor:
        logits = getattr(out, "logits", out)
        assert isinstance(logits, torch.Tensor)
        return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())

    return loss


def images(batch: int, side: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random RGB images of ``side`` x ``side`` pixels and labels of 10 classes."""
    return torch.randn(batch, 3, side, side, generator=gen), torch.randint(
        0, 10, (batch,), generator=gen
    )


_VOCAB = 2048


def token_task(
    model: nn.Module, blocks: list[nn.Module], batch: int, seq: int, gen: torch.Generator
) -> Built:
    """A token model's workload: random ids and labels over the zoo's vocabulary (ids drawn
    first), the cross-entropy of its logits."""
    ids = torch.randint(0, _VOCAB, (batch, seq), generator=gen)
    labels = torch.randint(0, _VOCAB, (batch, seq), generator=gen)
    return Built(model, blocks, (ids,), tokens_loss(labels))


def _bert(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    cfg = lib.BertConfig(
        vocab_size=_VOCAB,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads_for(width),
        intermediate_size=4 * width,
        max_position_embeddings=max(seq, 8),
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
    )
    model = lib.BertForMaskedLM(cfg)
    return token_task(model, list(model.bert.encoder.layer), batch, seq, gen)


def _t5(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    cfg = lib.T5Config(
        vocab_size=_VOCAB,
        d_model=width,
        d_kv=64 if width >= 64 else width,
        d_ff=4 * width,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads_for(width),
        dropout_rate=p,
        use_cache=False,
        decoder_start_token_id=0,
    )
    model = lib.T5ForConditionalGeneration(cfg)
    ids = torch.randint(0, _VOCAB, (batch, seq), generator=gen)
    dec = torch.randint(0, _VOCAB, (batch, max(1, seq // 2)), generator=gen)
    labels = torch.randint(0, _VOCAB, dec.shape, generator=gen)
    blocks = [*model.encoder.block, *model.decoder.block]
    return Built(model, blocks, (ids, torch.ones_like(ids), dec), tokens_loss(labels))


def _mixtral(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    cfg = lib.MixtralConfig(
        vocab_size=_VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads_for(width),
        num_key_value_heads=heads_for(width),
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=max(seq, 8),
        attention_dropout=p,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    model = lib.MixtralForCausalLM(cfg)
    return token_task(model, list(model.model.layers), batch, seq, gen)


def _vit(lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any) -> Built:
    cfg = lib.ViTConfig(
        image_size=side,
        patch_size=4,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads_for(width),
        intermediate_size=4 * width,
        num_labels=10,
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
    )
    model = lib.ViTForImageClassification(cfg)
    x, y = images(batch, side, gen)
    return Built(model, list(model.vit.layers), (x,), tokens_loss(y))


def _swin(lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any) -> Built:
    heads = max(1, width // 16)
    cfg = lib.SwinConfig(
        image_size=side,
        patch_size=4,
        embed_dim=width,
        depths=[2, 2, layers],
        num_heads=[heads, 2 * heads, 4 * heads],
        window_size=4,
        num_labels=10,
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
        drop_path_rate=0.0,
    )
    model = lib.SwinForImageClassification(cfg)
    x, y = images(batch, side, gen)
    blocks = [b for stage in model.swin.encoder.layers for b in stage.blocks]
    return Built(model, blocks, (x,), tokens_loss(y))


def _stage_depths(layers: int) -> list[int]:
    half = max(1, layers // 2)
    return [half, half, max(1, layers), half]


def _convnext(
    lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any
) -> Built:
    cfg = lib.ConvNextConfig(
        hidden_sizes=[width, 2 * width, 4 * width, 8 * width],
        depths=_stage_depths(layers),
        num_labels=10,
        image_size=side,
        drop_path_rate=0.0,
    )
    model = lib.ConvNextForImageClassification(cfg)
    x, y = images(batch, side, gen)
    blocks = [b for stage in model.convnext.encoder.stages for b in stage.layers]
    return Built(model, blocks, (x,), tokens_loss(y))


def _mobilenet(
    lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any
) -> Built:
    cfg = lib.MobileNetV2Config(
        image_size=side, depth_multiplier=width / 32, num_labels=10, classifier_dropout_prob=p
    )
    model = lib.MobileNetV2ForImageClassification(cfg)
    x, y = images(batch, side, gen)
    return Built(model, list(model.mobilenet_v2.layer), (x,), tokens_loss(y))


def _efficientnet(
    lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any
) -> Built:
    from transformers.models.efficientnet import modeling_efficientnet as m

    cfg = lib.EfficientNetConfig(
        image_size=side,
        width_coefficient=width / 32,
        depth_coefficient=0.5,
        num_labels=10,
        dropout_rate=p,
        drop_connect_rate=p,
    )
    # The config's hidden_dim (the top BatchNorm's size) does not follow width_coefficient,
    # while the top convolution's output does: set it to what that convolution produces.
    cfg.hidden_dim = m.round_filters(cfg, 1280)
    model = lib.EfficientNetForImageClassification(cfg)
    x, y = images(batch, side, gen)
    return Built(model, list(model.efficientnet.encoder.blocks), (x,), tokens_loss(y))


def _resnet(lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any) -> Built:
    per_stage = max(1, layers // 4)
    cfg = lib.ResNetConfig(
        embedding_size=width,
        hidden_sizes=[width, 2 * width, 4 * width, 8 * width],
        depths=[per_stage] * 4,
        layer_type="basic",
        num_labels=10,
    )
    model = lib.ResNetForImageClassification(cfg)
    x, y = images(batch, side, gen)
    blocks = [b for stage in model.resnet.encoder.stages for b in stage.layers]
    return Built(model, blocks, (x,), tokens_loss(y))


def _unet(lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any) -> Built:
    model = lib.UNet2DModel(
        sample_size=side,
        in_channels=3,
        out_channels=3,
        layers_per_block=layers,
        block_out_channels=(width, 2 * width, 2 * width),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=min(8, width),
        attention_head_dim=min(32, width),
        dropout=p,
    )
    x = torch.randn(batch, 3, side, side, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    noise = torch.randn(batch, 3, side, side, generator=gen)
    candidates = [m for m in model.modules() if type(m).__name__ in ("ResnetBlock2D", "Attention")]

    def loss(out: object) -> torch.Tensor:
        return F.mse_loss(out.sample.float(), noise)  # type: ignore[attr-defined]

    return Built(model, in_call_order(model, (x, t), candidates), (x, t), loss)


class _Loop(nn.Module):
    """Holds the parameters of blocks that a plain function calls in a loop.

    ``__call__`` is the loop itself, not ``nn.Module.__call__``: no module wraps the blocks
    while they run (module hooks see each block as an outermost module), as in a training
    script that keeps its layers in a Python list.
    """

    def __init__(self, blocks: Sequence[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def _loop(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    blocks: list[nn.Module] = [
        nn.TransformerEncoderLayer(
            width, heads_for(width), 4 * width, p, batch_first=True, norm_first=True
        )
        for _ in range(layers)
    ]
    model = _Loop(blocks, nn.Linear(width, 1024))
    x = torch.randn(batch, seq, width, generator=gen)
    labels = torch.randint(0, 1024, (batch, seq), generator=gen)
    return Built(model, blocks, (x,), tokens_loss(labels))


def in_call_order(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], modules: Sequence[nn.Module]
) -> list[nn.Module]:
    """``modules`` in the order one forward first calls them (no gradients; RNG restored)."""
    first: dict[int, int] = {}

    def seen(mod: nn.Module, args: object) -> None:  # None: the arguments stay as they are
        first.setdefault(id(mod), len(first))

    handles = [m.register_forward_pre_hook(seen) for m in modules]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return sorted((m for m in modules if id(m) in first), key=lambda m: first[id(m)])


_BUILDERS: dict[str, Callable[..., Built]] = {
    "hf-bert": _bert,
    "hf-t5": _t5,
    "hf-mixtral": _mixtral,
    "hf-vit": _vit,
    "hf-swin": _swin,
    "hf-convnext": _convnext,
    "hf-mobilenetv2": _mobilenet,
    "hf-efficientnet": _efficientnet,
    "hf-resnet": _resnet,
    "diffusers-unet": _unet,
    "torch-loop": _loop,
}
