"""A tiny random Stable Diffusion 1.x-style folder (CLIPTextModel, UNet2DConditionModel, AutoencoderKL), offline."""

from __future__ import annotations

from pathlib import Path

import torch

from . import clip_tokenizer


def build_tiny_sd(path: str | Path, seed: int = 0, channels: tuple[int, int] = (32, 64), sample_size: int = 8,
                  scheduler: str = "DDIMScheduler", prediction_type: str = "epsilon", inpainting: bool = False) -> Path:
    """Write the folder and return its path. `channels`: the UNet's block widths (raise them for benchmarks);
    `sample_size`: the UNet's native latent size (images are twice that: the VAE has two blocks); `inpainting`:
    an inpainting UNet (9 input channels: latents, mask, masked image latents) saved as a
    StableDiffusionInpaintPipeline."""
    import diffusers
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = clip_tokenizer(77)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=77))
    unet = UNet2DConditionModel(
        sample_size=sample_size, in_channels=9 if inpainting else 4, out_channels=4, layers_per_block=1, block_out_channels=channels,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16)
    vae = AutoencoderKL(
        block_out_channels=(16, 32), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=16,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    sched = getattr(diffusers, scheduler)(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type=prediction_type, steps_offset=1, timestep_spacing="leading")
    pipeline = diffusers.StableDiffusionInpaintPipeline if inpainting else diffusers.StableDiffusionPipeline
    pipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=sched, safety_checker=None,
             feature_extractor=None, requires_safety_checker=False).save_pretrained(path)
    return path

# The size benchmarks/families.py builds: wide enough that a forward costs more at batch 8 than at batch 1.
BENCH_OPTIONS = {"channels": (64, 128), "sample_size": 16}
