"""Models beyond the zoo: architectures tried on the automatic paths, outside the benchmark.

The zoo (``third_party``) is the benchmark whose figures lead the README; the models here are
a second set of different kinds, tried to find what the automatic paths (one region
``recompute_all``, ``memory_budget``, block boundaries) do on programs nobody here wrote:
a convolutional front end with weight-normed positional convolution and a CTC loss
(Wav2Vec2), an encoder-decoder with learned positions (BART), disentangled relative attention
(DeBERTa-v2), parallel attention and MLP with partial rotary embeddings (GPT-NeoX), a mixture
of experts with a gated shared expert (Qwen2-MoE), a selective state-space recurrence run op by
op (Mamba, transformers' path without its CUDA kernels), efficient attention with spatial
reduction and a depthwise-convolution MLP (SegFormer), two towers and a contrastive loss
(CLIP), and a variational autoencoder that samples its latent inside the forward (diffusers'
AutoencoderKL). ``benchmarks/bench_zoo.py --extra`` runs them; ``compare --model NAME`` too.

Example:
    >>> from ckpt_graph.compare.zoo import build_workload
    >>> w = build_workload("hf-gpt-neox", layers=2, width=32, batch=2, seq_len=8)
    >>> len(w.blocks)
    2
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_graph.compare.third_party import (
    Built,
    Spec,
    heads_for,
    images,
    in_call_order,
    load_library,
    rough_bytes,
    token_task,
    tokens_loss,
)

__all__ = ["SPECS", "TINY_SIZES", "Keywords", "build", "estimate_bytes"]

# Note [Models beyond the zoo]
# These models are not part of the zoo's default run (its time and the README's headline stay
# as they are). Their default sizes are smaller than the zoo's (a step without checkpointing
# takes 23-62 ms of CPU time on one thread) so that the set runs through bench_zoo.py in about
# half an hour on 2 shared cores (32 min at load 8-11, BENCHMARKS.md "Models beyond the zoo");
# their ops are small, so their step times say little. Each keeps the library's own model class
# and config, sizes changed only, with two exceptions that make the step deterministic, as the
# benchmark compares gradients across strategies: Wav2Vec2 without SpecAugment's time masking
# (drawn with NumPy's generator, a new mask per step) and without LayerDrop (a Python branch on
# a random draw).

_VOCAB = 2048
_TEXT = "layers: blocks; width: hidden size (head size 64, MLP 4x); seq_len: tokens"

SPECS: dict[str, Spec] = {
    "hf-wav2vec2": Spec(
        "transformers",
        "Wav2Vec2ForCTC: 3 strided convolutions (GroupNorm) on raw audio, weight-normed "
        "positional convolution, post-norm encoder, CTC loss",
        2,
        128,
        4,
        128,
        "layers: encoder blocks (the 3 convolutions are blocks too); width: hidden size and "
        "convolution channels (head size 64, MLP 4x); seq_len: frames after the convolutions "
        "(20 audio samples each)",
    ),
    "hf-bart": Spec(
        "transformers",
        "BartForConditionalGeneration (encoder and decoder, learned positions)",
        2,
        128,
        4,
        128,
        "layers: encoder blocks (as many decoder blocks); width: d_model (head size 64, "
        "FFN 4x); seq_len: encoder tokens (decoder: half)",
    ),
    "hf-deberta-v2": Spec(
        "transformers",
        "DebertaV2ForMaskedLM, disentangled relative attention (c2p, p2c), 32 buckets",
        3,
        128,
        4,
        128,
        _TEXT,
    ),
    "hf-gpt-neox": Spec(
        "transformers",
        "GPTNeoXForCausalLM, parallel attention and MLP, rotary on a quarter of each head",
        4,
        128,
        4,
        128,
        _TEXT,
    ),
    "hf-qwen2-moe": Spec(
        "transformers",
        "Qwen2MoeForCausalLM, 4 experts, top-2 routing, a gated shared expert, 2 KV heads",
        3,
        128,
        4,
        128,
        "layers: blocks; width: hidden size (head size 16, experts 1x, shared expert 2x); "
        "seq_len: tokens",
    ),
    "hf-mamba": Spec(
        "transformers",
        "MambaForCausalLM, state size 8, transformers' path without CUDA kernels",
        3,
        64,
        4,
        32,
        "layers: blocks; width: hidden size (inner 2x); seq_len: tokens (a scan step each)",
    ),
    "hf-segformer": Spec(
        "transformers",
        "SegformerForSemanticSegmentation, 4 stages, spatial-reduction attention, "
        "depthwise-convolution MLP, all-MLP decoder",
        8,
        16,
        2,
        64,
        "layers: blocks (L/4 per stage); width: channels of the first stage (then 2x, 5x, "
        "8x); seq_len: image side (labels at a quarter of it)",
    ),
    "hf-clip": Spec(
        "transformers",
        "CLIPModel, text and vision towers, 4 x 4 patches of 32 x 32 images, contrastive loss",
        3,
        128,
        8,
        64,
        "layers: blocks per tower; width: hidden size of both towers (head size 64, MLP 4x); "
        "seq_len: tokens",
    ),
    "diffusers-vae": Spec(
        "diffusers",
        "AutoencoderKL, 3 levels, the latent sampled in the forward, reconstruction MSE loss",
        1,
        16,
        2,
        64,
        "layers: resnets per level; width: channels of the first level (then 2x, 2x); "
        "seq_len: image side",
    ),
}

# The smallest sizes that keep each architecture whole: the tests' sizes.
TINY_SIZES: dict[str, dict[str, int]] = {
    "hf-wav2vec2": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-bart": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-deberta-v2": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-gpt-neox": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-qwen2-moe": dict(layers=2, width=32, batch=2, seq_len=8),
    "hf-mamba": dict(layers=2, width=16, batch=2, seq_len=6),
    "hf-segformer": dict(layers=8, width=8, batch=1, seq_len=32),
    "hf-clip": dict(layers=2, width=32, batch=2, seq_len=8),
    "diffusers-vae": dict(layers=1, width=8, batch=1, seq_len=16),
}


class Keywords(nn.Module):
    """Calls a library model with keyword arguments: ``Keywords(m, ("a",), b=1)(x)`` is
    ``m(a=x, b=1)``. The workloads pass their batch positionally; some models take what they
    need only by keyword."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], **fixed: object) -> None:
        super().__init__()
        self.model = model
        self.names = names
        self.fixed = fixed

    def forward(self, *tensors: torch.Tensor) -> object:
        return self.model(**dict(zip(self.names, tensors, strict=True)), **self.fixed)


def estimate_bytes(name: str, layers: int, width: int, batch: int, seq_len: int) -> int:
    """Rough upper estimate of one step's memory without checkpointing, in bytes (fp32)."""
    image = name in ("hf-segformer", "diffusers-vae")
    if name == "hf-wav2vec2":  # the convolutions run on 20 audio samples per frame
        seq_len *= 20
    return rough_bytes(layers, width, batch, seq_len, image)


def build(name: str, sizes: dict[str, int], dropout: float, gen: torch.Generator) -> Built:
    """Build a model of :data:`SPECS` (random weights from the global RNG; batch from ``gen``).

    Raises:
        MissingLibrary: the model's library is not installed.
    """
    lib = load_library(name, SPECS[name])
    layers, width, batch, seq_len = (sizes[k] for k in ("layers", "width", "batch", "seq_len"))
    return _BUILDERS[name](lib, layers, width, batch, seq_len, dropout, gen)


def _wav2vec2(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    cfg = lib.Wav2Vec2Config(
        vocab_size=32,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads_for(width),
        intermediate_size=4 * width,
        conv_dim=(width, width, width),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        hidden_dropout=p,
        attention_dropout=p,
        activation_dropout=p,
        feat_proj_dropout=p,
        final_dropout=p,
        layerdrop=0.0,
        mask_time_prob=0.0,  # See Note [Models beyond the zoo].
        pad_token_id=0,
    )
    model = lib.Wav2Vec2ForCTC(cfg)
    audio = torch.randn(batch, 20 * seq + 15, generator=gen)
    targets = torch.randint(1, 32, (batch, max(1, seq // 4)), generator=gen)
    blocks = [*model.wav2vec2.feature_extractor.conv_layers, *model.wav2vec2.encoder.layers]

    def ctc(out: object) -> torch.Tensor:
        logits: torch.Tensor = out.logits  # type: ignore[attr-defined]
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)
        frames = torch.full((batch,), log_probs.shape[0], dtype=torch.long)
        lengths = torch.full((batch,), targets.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, targets, frames, lengths, zero_infinity=True)

    return Built(model, blocks, (audio,), ctc)


def _bart(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    heads = heads_for(width)
    cfg = lib.BartConfig(
        vocab_size=_VOCAB,
        d_model=width,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=4 * width,
        decoder_ffn_dim=4 * width,
        max_position_embeddings=max(seq, 8),
        dropout=p,
        attention_dropout=p,
        activation_dropout=p,
        use_cache=False,
    )
    model = lib.BartForConditionalGeneration(cfg)
    ids = torch.randint(3, _VOCAB, (batch, seq), generator=gen)
    dec = torch.randint(3, _VOCAB, (batch, max(1, seq // 2)), generator=gen)
    labels = torch.randint(3, _VOCAB, dec.shape, generator=gen)
    blocks = [*model.model.encoder.layers, *model.model.decoder.layers]
    return Built(model, blocks, (ids, torch.ones_like(ids), dec), tokens_loss(labels))


def _deberta(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    cfg = lib.DebertaV2Config(
        vocab_size=_VOCAB,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads_for(width),
        intermediate_size=4 * width,
        max_position_embeddings=max(seq, 8),
        relative_attention=True,
        position_buckets=32,
        pos_att_type=["p2c", "c2p"],
        position_biased_input=False,
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
    )
    model = lib.DebertaV2ForMaskedLM(cfg)
    return token_task(model, list(model.deberta.encoder.layer), batch, seq, gen)


def _neox(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    cfg = lib.GPTNeoXConfig(
        vocab_size=_VOCAB,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads_for(width),
        intermediate_size=4 * width,
        rotary_pct=0.25,
        use_parallel_residual=True,
        max_position_embeddings=max(seq, 8),
        attention_dropout=p,
        hidden_dropout=p,
        use_cache=False,
    )
    model = lib.GPTNeoXForCausalLM(cfg)
    return token_task(model, list(model.gpt_neox.layers), batch, seq, gen)


def _qwen2_moe(
    lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any
) -> Built:
    heads = heads_for(width, 16)
    cfg = lib.Qwen2MoeConfig(
        vocab_size=_VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        moe_intermediate_size=width,
        shared_expert_intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=max(seq, 8),
        attention_dropout=p,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    model = lib.Qwen2MoeForCausalLM(cfg)
    return token_task(model, list(model.model.layers), batch, seq, gen)


def _mamba(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    cfg = lib.MambaConfig(
        vocab_size=_VOCAB,
        hidden_size=width,
        state_size=8,
        num_hidden_layers=layers,
        expand=2,
        conv_kernel=4,
        use_cache=False,
    )
    model = lib.MambaForCausalLM(cfg)
    return token_task(model, list(model.backbone.layers), batch, seq, gen)


def _segformer(
    lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any
) -> Built:
    per_stage = max(1, layers // 4)
    cfg = lib.SegformerConfig(
        depths=[per_stage] * 4,
        hidden_sizes=[width, 2 * width, 5 * width, 8 * width],
        num_attention_heads=[1, 2, 5, 8],
        decoder_hidden_size=4 * width,
        num_labels=10,
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
        classifier_dropout_prob=p,
        drop_path_rate=0.0,
    )
    model = lib.SegformerForSemanticSegmentation(cfg)
    x = torch.randn(batch, 3, side, side, generator=gen)
    labels = torch.randint(0, 10, (batch, side // 4, side // 4), generator=gen)
    blocks = [b for stage in model.segformer.stages for b in stage.blocks]

    def loss(out: object) -> torch.Tensor:
        return F.cross_entropy(out.logits.float(), labels)  # type: ignore[attr-defined]

    return Built(model, blocks, (x,), loss)


def _clip(lib: Any, layers: int, width: int, batch: int, seq: int, p: float, gen: Any) -> Built:
    tower = dict(
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads_for(width),
        attention_dropout=p,
    )
    cfg = lib.CLIPConfig(
        text_config=dict(
            tower,
            vocab_size=_VOCAB,
            max_position_embeddings=max(seq, 8),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(tower, image_size=32, patch_size=4),
        projection_dim=width,
    )
    model = lib.CLIPModel(cfg)
    ids = torch.randint(0, _VOCAB, (batch, seq), generator=gen)
    x, _ = images(batch, 32, gen)
    target = torch.arange(batch)

    def contrastive(out: object) -> torch.Tensor:
        per_text: torch.Tensor = out.logits_per_text.float()  # type: ignore[attr-defined]
        return (F.cross_entropy(per_text, target) + F.cross_entropy(per_text.t(), target)) / 2

    blocks = [*model.text_model.encoder.layers, *model.vision_model.encoder.layers]
    return Built(model, in_call_order(model, (ids, x), blocks), (ids, x), contrastive)


def _vae(lib: Any, layers: int, width: int, batch: int, side: int, p: float, gen: Any) -> Built:
    vae = lib.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(width, 2 * width, 2 * width),
        layers_per_block=layers,
        latent_channels=4,
        norm_num_groups=min(8, width),
        sample_size=side,
    )
    model = Keywords(vae, ("sample",), sample_posterior=True)
    x = torch.randn(batch, 3, side, side, generator=gen)
    candidates = [m for m in vae.modules() if type(m).__name__ in ("ResnetBlock2D", "Attention")]

    def loss(out: object) -> torch.Tensor:
        return F.mse_loss(out.sample.float(), x)  # type: ignore[attr-defined]

    return Built(model, in_call_order(model, (x,), candidates), (x,), loss)


_BUILDERS: dict[str, Callable[..., Built]] = {
    "hf-wav2vec2": _wav2vec2,
    "hf-bart": _bart,
    "hf-deberta-v2": _deberta,
    "hf-gpt-neox": _neox,
    "hf-qwen2-moe": _qwen2_moe,
    "hf-mamba": _mamba,
    "hf-segformer": _segformer,
    "hf-clip": _clip,
    "diffusers-vae": _vae,
}
