"""A tiny random Qwen-Image pipeline (diffusers `QwenImagePipeline`), built offline and saved as a diffusers folder.

The shapes follow diffusers' own Qwen-Image fast tests (tests/pipelines/qwenimage): a `QwenImageTransformer2DModel`
with two blocks, head dim 16 and RoPE axes (8, 4, 4); an `AutoencoderKLQwenImage` (a video VAE run on one frame)
with 4 latent channels and a 4x spatial downscale; a `Qwen2_5_VLForConditionalGeneration` text encoder of width 16
(its vision tower is never run for text to image). What is this module's own:

- the tokenizer: a byte-level BPE over the 256 byte symbols and no merges (one token per byte), with Qwen's chat
  tokens `<|im_start|>` / `<|im_end|>`, built in memory (the real model's vocabulary is not downloaded). So the
  pipeline's chat template (whose first 34 tokens it drops) is longer here, about 130 tokens before the prompt;
- per-channel `latents_mean` / `latents_std` that are not 0 / 1, so that the decoder's de-normalisation is
  exercised;
- the scheduler config of the real Qwen/Qwen-Image (a dynamic shift, exponential, from base_shift 0.5 at 256
  image tokens to max_shift 0.9 at 8192, and `shift_terminal` 0.02);
- the transformer's matrices redrawn from N(0, 1/fan_in) (LeCun normal), as the tiny Flux's: with the default
  init a random transformer this small barely listens to its text.

A `stepserve.json` narrows the served sizes to 16..64 pixels (default 32x32) and 8 steps by default, so the tiny
model stays cheap to serve. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import qwen_tokenizer

LATENT_CHANNELS = 4
TEXT_WIDTH = 16  # = the transformer's joint_attention_dim (3584 in Qwen-Image)
# Qwen/Qwen-Image's scheduler/scheduler_config.json
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_image_seq_len=256,
                        max_image_seq_len=8192, base_shift=0.5, max_shift=0.9, shift_terminal=0.02,
                        time_shift_type="exponential", invert_sigmas=False, stochastic_sampling=False,
                        use_beta_sigmas=False, use_exponential_sigmas=False, use_karras_sigmas=False)

# The size benchmarks use: a wider transformer at 64x64 images.
BENCH_OPTIONS = {"heads": 8, "layers": 4, "default_size": 64}


def build_tiny_qwenimage(path: str | Path, *, seed: int = 0, heads: int = 2, layers: int = 2,
                         default_size: int = 32) -> Path:
    """Write a complete QwenImagePipeline folder with random weights to `path`; returns `path`. `heads` (of width
    16) and `layers` size the transformer; `default_size`: the served default image side (half to twice it)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    tokenizer = qwen_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": TEXT_WIDTH, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
                     "bos_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.pad_token_id,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": TEXT_WIDTH},
        hidden_size=TEXT_WIDTH, vocab_size=len(tokenizer), image_token_id=len(tokenizer) + 1,
        video_token_id=len(tokenizer) + 2, vision_start_token_id=len(tokenizer) + 3,
        vision_end_token_id=len(tokenizer) + 4)).eval()
    torch.manual_seed(seed + 1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS * 4, out_channels=LATENT_CHANNELS, num_layers=layers,
        attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=TEXT_WIDTH, guidance_embeds=False,
        axes_dims_rope=(8, 4, 4))
    with torch.no_grad():
        for weight in (p for p in transformer.parameters() if p.ndim == 2):
            weight.normal_(0.0, weight.shape[1] ** -0.5)
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(
        base_dim=LATENT_CHANNELS * 6, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 4], num_res_blocks=1,
        temperal_downsample=[False, True], latents_mean=[-0.3, 0.1, 0.25, -0.05],
        latents_std=[1.6, 2.2, 1.9, 2.6])
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    pipe.save_pretrained(path)
    serving = {"height": default_size, "width": default_size, "min_size": default_size // 2,
               "max_size": default_size * 2, "default_steps": 8}
    (path / "stepserve.json").write_text(json.dumps(serving, indent=2) + "\n")
    return path
