"""A tiny random Flux.1 pipeline (dev or schnell config), built offline and saved as a diffusers folder.

The shapes follow diffusers' own Flux fast tests (tests/pipelines/flux: a `FluxTransformer2DModel` with one double-
and one single-stream block, head dim 16, RoPE axes (4, 4, 8)) scaled so that every part of the real pipeline is
exercised: 16 latent channels packed into 2x2 patches (transformer in_channels 64), an `AutoencoderKL` with Flux's
`shift_factor` / `scaling_factor` and no quant convs, a `CLIPTextModel` whose pooled output feeds
`pooled_projections`, a `T5EncoderModel` whose token embeddings are the joint-attention context (512 tokens, the
FluxPipeline default), and `FlowMatchEulerDiscreteScheduler` with the scheduler config each real model ships:

- dev: guidance-distilled (`guidance_embeds=True`), `use_dynamic_shifting=True` (per-resolution `mu` between
  base_shift 0.5 at 256 image tokens and max_shift 1.15 at 4096);
- schnell: timestep-distilled (`guidance_embeds=False`), a fixed shift of 1.0.

The transformer's matrices are redrawn from N(0, 1/fan_in) (LeCun normal): with diffusers' default init a random
transformer this small barely listens to its conditioning (a changed prompt moved pixels by ~3/255), too little for
a test to tell a right encoding from a wrong one; redrawn, prompt, guidance and step count each move them by tens.

A `stepserve.json` narrows the served sizes to 16..64 pixels (default 32x32, `default_size`; schnell: 4 steps by default, as its
model card runs it), so the tiny model stays cheap to serve; without it a Flux folder serves FluxPipeline's own
defaults. Tokenizers are built from in-memory vocabularies: nothing is downloaded.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

from . import clip_tokenizer

VARIANTS = ("dev", "schnell")
CLIP_MAX_LENGTH = 77  # FluxPipeline truncates CLIP prompts to tokenizer.model_max_length
T5_MAX_LENGTH = 512  # FluxPipeline's max_sequence_length default
CLIP_WIDTH = 32  # = transformer pooled_projection_dim (768 in Flux.1)
T5_WIDTH = 32  # = transformer joint_attention_dim (4096 in Flux.1)
LATENT_CHANNELS = 16
VAE_SHIFT_FACTOR = 0.1159  # Flux.1's VAE config values
VAE_SCALING_FACTOR = 0.3611
VAE_SCALE = 2  # the tiny VAE downscales by 2 (two blocks); Flux.1's by 8
# The scheduler_config.json of each real model (black-forest-labs/FLUX.1-dev and FLUX.1-schnell).
SCHEDULER_CONFIGS = {
    "dev": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15),
    "schnell": dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_image_seq_len=256,
                    max_image_seq_len=4096, base_shift=0.5, max_shift=1.15),
}


def t5_tokenizer():
    """A T5 (Unigram, SentencePiece-style) tokenizer over single characters and word-initial characters."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    for c in (c for c in string.printable if not c.isspace()):
        pieces += [("\u2581" + c, -3.0), (c, -4.0)]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


# benchmarks/families.py builds this size: a wider transformer (1.9M parameters, inner width 128) at 64x64
# images (256 image tokens beside the 512 T5 tokens).
BENCH_OPTIONS = {"heads": 8, "layers": (2, 2), "default_size": 64}


def build_tiny_flux(path: str | Path, *, variant: str = "dev", seed: int = 0, heads: int = 2,
                    layers: tuple[int, int] = (1, 1), default_size: int = 32, fill: bool = False) -> Path:
    """Write a complete FluxPipeline folder with random weights to `path` (`variant` "dev" or "schnell");
    returns `path`. `heads` (of width 16) and `layers` (double-stream, single-stream blocks) size the transformer
    (raise them for benchmarks); `default_size`: the served default image side (sizes from half to twice it);
    `fill`: a FluxFillPipeline folder (inpainting: the transformer also takes the packed masked image and mask)."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxFillPipeline, FluxPipeline,
                           FluxTransformer2DModel)
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    path = Path(path)
    tokenizer, tokenizer_2 = clip_tokenizer(CLIP_MAX_LENGTH), t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=CLIP_WIDTH, intermediate_size=37,
        layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=2, vocab_size=len(tokenizer),
        max_position_embeddings=CLIP_MAX_LENGTH, hidden_act="gelu", projection_dim=CLIP_WIDTH))
    torch.manual_seed(seed + 1)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=T5_WIDTH, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    torch.manual_seed(seed + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS * 4 * (2 if fill else 1) + (4 * VAE_SCALE**2 if fill else 0),
        out_channels=LATENT_CHANNELS * 4, num_layers=layers[0], num_single_layers=layers[1],
        attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=T5_WIDTH, pooled_projection_dim=CLIP_WIDTH,
        guidance_embeds=variant == "dev", axes_dims_rope=(4, 4, 8))
    with torch.no_grad():
        for weight in (p for p in transformer.parameters() if p.ndim == 2):
            weight.normal_(0.0, weight.shape[1] ** -0.5)
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=LATENT_CHANNELS, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=VAE_SHIFT_FACTOR, scaling_factor=VAE_SCALING_FACTOR)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS[variant])
    pipe = (FluxFillPipeline if fill else FluxPipeline)(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(path)
    serving = {"height": default_size, "width": default_size, "min_size": default_size // 2,
               "max_size": default_size * 2}
    if variant == "schnell":
        serving["default_steps"] = 4
    (path / "stepserve.json").write_text(json.dumps(serving, indent=2) + "\n")
    return path
