"""The models benchmarks/gpu_check.py measures: an SD-1.5-sized pipeline with random weights from the real configs
(UNet 860M, VAE, CLIP ViT-L text encoder; nothing downloaded), the tiny one of --smoke, and the Flux.1-dev
transformer's config."""

from __future__ import annotations

from pathlib import Path

import torch

# runwayml/stable-diffusion-v1-5: unet/config.json, vae/config.json, text_encoder/config.json (CLIP ViT-L/14)
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, cross_attention_dim=768,
                 attention_head_dim=8, block_out_channels=(320, 640, 1280, 1280), norm_num_groups=32,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
SD15_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
                block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32, scaling_factor=0.18215)
SD15_TEXT = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
# black-forest-labs/FLUX.1-dev transformer/config.json
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))


def build_sd15(path: Path, dtype: torch.dtype, device: str) -> Path:
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from stepserve.tiny import clip_tokenizer

    torch.manual_seed(0)
    tokenizer = clip_tokenizer(77)
    with torch.device(device):  # random init on the device: seconds instead of minutes for 860M parameters
        text = CLIPTextModel(CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1,
                                            vocab_size=max(len(tokenizer), 49408), **SD15_TEXT))
        unet, vae = UNet2DConditionModel(**SD15_UNET), AutoencoderKL(**SD15_VAE)
    sched = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                          steps_offset=1, clip_sample=False, set_alpha_to_one=False)
    StableDiffusionPipeline(vae=vae.to(dtype), text_encoder=text.to(dtype), tokenizer=tokenizer,
                            unet=unet.to(dtype), scheduler=sched, safety_checker=None, feature_extractor=None,
                            requires_safety_checker=False).save_pretrained(path)
    return path


def build_tiny(path: Path) -> Path:
    from stepserve.tiny.sd import build_tiny_sd

    return build_tiny_sd(path)
