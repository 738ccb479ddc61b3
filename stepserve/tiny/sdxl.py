"""A tiny random Stable Diffusion XL folder, built offline with the component shapes of diffusers' own SDXL fast
tests (UNet with addition_embed_type "text_time", CLIPTextModel + CLIPTextModelWithProjection, AutoencoderKL)."""

from __future__ import annotations

from pathlib import Path

import torch

from . import clip_tokenizer


def build_tiny_sdxl(path: str | Path, seed: int = 0, channels: tuple[int, int] = (32, 64), sample_size: int = 8,
                    scheduler: str = "EulerDiscreteScheduler", force_zeros_for_empty_prompt: bool = True,
                    inpainting: bool = False) -> Path:
    """Write the folder and return its path. `channels`: the UNet's block widths (raise them for benchmarks, where
    the denoiser must cost enough for batching to show); `sample_size`: the UNet's native latent size (images are
    twice that: the VAE has two blocks); `inpainting`: a 9-channel inpainting UNet, saved as a
    StableDiffusionXLInpaintPipeline."""
    import diffusers
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    path = Path(path)
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = clip_tokenizer(77), clip_tokenizer(77, pad_token="!")
    text_config = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37,
                       layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=3, vocab_size=len(tokenizer),
                       max_position_embeddings=77, hidden_act="gelu", projection_dim=32)
    text_encoder = CLIPTextModel(CLIPTextConfig(**text_config))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**text_config))
    unet = UNet2DConditionModel(
        sample_size=sample_size, in_channels=9 if inpainting else 4, out_channels=4, layers_per_block=1,
        block_out_channels=channels,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 32, cross_attention_dim=64, norm_num_groups=16)
    vae = AutoencoderKL(
        block_out_channels=(16, 32), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=16,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        sample_size=sample_size * 2, scaling_factor=0.13025)
    sched = getattr(diffusers, scheduler)(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        steps_offset=1, timestep_spacing="leading")
    pipeline = diffusers.StableDiffusionXLInpaintPipeline if inpainting else diffusers.StableDiffusionXLPipeline
    pipe = pipeline(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet, scheduler=sched,
                                     force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
                                     add_watermarker=False)
    pipe.save_pretrained(path)
    return path

# The size benchmarks/families.py builds: wide enough that a forward costs more at batch 8 than at batch 1.
BENCH_OPTIONS = {"channels": (64, 128), "sample_size": 16}
