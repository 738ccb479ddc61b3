"""A tiny random Stable Diffusion pipeline built offline, saved as a diffusers folder (model_index.json)."""

from __future__ import annotations

import string
from pathlib import Path

import torch


def tiny_tokenizer(max_length: int = 16):
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in (c for c in string.printable if not c.isspace()):
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def build_tiny_sd(path: Path, prediction_type: str = "epsilon", scheduler: str = "DDIMScheduler",
                  seed: int = 0) -> Path:
    import diffusers
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=16))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16)
    vae = AutoencoderKL(
        block_out_channels=(16, 32), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=16,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    sched = getattr(diffusers, scheduler)(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type=prediction_type, steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=sched, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(path)
    return path


# The tests' own statement of which diffusers class each sampler must match, written out independently of
# stepserve.request.types.SCHEDULER_CLASSES (tests/test_constants.py checks that the two agree).
SCHEDULER_CLASS = {
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
    "flow_euler": "FlowMatchEulerDiscreteScheduler",
}
# The samplers of the Stable Diffusion family (flow_euler needs a flow-matching model, which the tiny one is not).
SD_SAMPLERS = tuple(s for s in SCHEDULER_CLASS if s != "flow_euler")


def reference_image(path: Path, params):
    """What diffusers' own StableDiffusionPipeline gives for one prompt with these settings."""
    import diffusers
    import numpy as np

    pipe = _load(path)
    pipe.scheduler = getattr(diffusers, SCHEDULER_CLASS[params.sampler]).from_config(pipe.scheduler.config)
    image = pipe(params.prompt, negative_prompt=params.negative_prompt or None, height=params.height,
                 width=params.width, num_inference_steps=params.num_inference_steps,
                 guidance_scale=params.guidance_scale, generator=torch.Generator("cpu").manual_seed(params.seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.uint8)


_PIPES: dict = {}


def _load(path: Path):
    from diffusers import StableDiffusionPipeline

    key = str(path)
    if key not in _PIPES:
        pipe = StableDiffusionPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[key] = pipe
    return _PIPES[key]
