"""A tiny random Stable Diffusion 3 pipeline, built offline and saved as a diffusers folder (model_index.json).

The shapes follow diffusers' own SD3 fast tests (tests/pipelines/stable_diffusion_3) scaled so that every part of
the real pipeline is exercised: an MMDiT `SD3Transformer2DModel` with patch size 2; an `AutoencoderKL` with SD3's
16 latent channels, `shift_factor` and `scaling_factor`; two `CLIPTextModelWithProjection` of different widths
(CLIP-L and CLIP-G, whose pooled outputs are concatenated and whose token embeddings are padded to the T5 width);
an optional `T5EncoderModel` (without it the pipeline uses zeros of length 256); CLIP tokenizers of 77 tokens (the
second pads with "!" as SD3's CLIP-G tokenizer does); a T5 tokenizer built from a Unigram vocabulary (nothing is
downloaded); and `FlowMatchEulerDiscreteScheduler(shift=3.0)`, SD3's scheduler config.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from . import clip_tokenizer

CLIP_MAX_LENGTH = 77  # diffusers' SD3 pipeline truncates CLIP prompts to the tokenizer's model_max_length
CLIP_L_WIDTH = 32
CLIP_G_WIDTH = 64
T5_WIDTH = 128  # = transformer joint_attention_dim (4096 in SD3); CLIP-L + CLIP-G tokens are padded up to it
SAMPLE_SIZE = 16  # latent size of the default image: 16 * vae scale 2 = 32x32 pixels
VAE_SHIFT_FACTOR = 0.0609  # SD3's VAE config values
VAE_SCALING_FACTOR = 1.5305
VARIANTS = ("sd3", "sd3.5")
# benchmarks/families.py builds this size: a wider, deeper transformer at 64x64 pixels (256 image tokens), where a
# forward costs enough that batching shows
BENCH_OPTIONS = {"heads": 8, "layers": 4, "sample_size": 32}


def t5_tokenizer():
    """A T5 (Unigram, SentencePiece-style) tokenizer over single characters and word-initial characters."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    for c in (c for c in string.printable if not c.isspace()):
        pieces += [("\u2581" + c, -3.0), (c, -4.0)]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def _clip(width: int, vocab_size: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=width, intermediate_size=37,
        layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=2, vocab_size=vocab_size,
        max_position_embeddings=CLIP_MAX_LENGTH, hidden_act="gelu", projection_dim=width))


def build_tiny_sd3(path: str | Path, *, with_t5: bool = True, variant: str = "sd3", dynamic_shifting: bool = False,
                   seed: int = 0, heads: int = 4, layers: int = 2, sample_size: int = SAMPLE_SIZE) -> Path:
    """Write a complete StableDiffusion3Pipeline folder with random weights to `path`; returns `path`.

    `with_t5=False` leaves out text_encoder_3 / tokenizer_3 (as SD3 may be run without T5): the pipeline then
    feeds zeros in place of the T5 embeddings. `variant="sd3.5"` gives the transformer SD3.5's RMS-normed
    query/key and (as SD3.5 Medium) a dual-attention (MMDiT-X) first layer. `dynamic_shifting=True` makes the
    scheduler shift by resolution (`use_dynamic_shifting`, mu from the image token count), with base/max token
    counts scaled to the tiny sizes (16 and 256 tokens: 16x16 to 64x64 pixels). `heads` (of width 8), `layers`
    and `sample_size` (latent pixels; the image is twice that) size the transformer."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    path = Path(path)
    tokenizer, tokenizer_2 = clip_tokenizer(CLIP_MAX_LENGTH), clip_tokenizer(CLIP_MAX_LENGTH, pad_token="!")
    text_encoder = _clip(CLIP_L_WIDTH, len(tokenizer), seed)
    text_encoder_2 = _clip(CLIP_G_WIDTH, len(tokenizer_2), seed + 1)
    tokenizer_3 = text_encoder_3 = None
    if with_t5:
        tokenizer_3 = t5_tokenizer()
        torch.manual_seed(seed + 2)
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=T5_WIDTH, d_kv=16, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    torch.manual_seed(seed + 3)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
        attention_head_dim=8, num_attention_heads=heads, caption_projection_dim=8 * heads, joint_attention_dim=T5_WIDTH,
        pooled_projection_dim=CLIP_L_WIDTH + CLIP_G_WIDTH, pos_embed_max_size=max(32, sample_size),
        **({"qk_norm": "rms_norm", "dual_attention_layers": (0,)} if variant == "sd3.5" else {}))
    torch.manual_seed(seed + 4)
    vae = AutoencoderKL(
        sample_size=sample_size * 2, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=16, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=VAE_SHIFT_FACTOR, scaling_factor=VAE_SCALING_FACTOR)
    shifting = {"use_dynamic_shifting": True, "base_image_seq_len": 16, "max_image_seq_len": 256} \
        if dynamic_shifting else {}
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, **shifting)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3)
    pipe.save_pretrained(path)
    return path
