"""A tiny random Flux.2 pipeline, [klein] (diffusers `Flux2KleinPipeline`) or [dev] (`Flux2Pipeline`), built
offline and saved as a diffusers folder.

The shapes follow diffusers' own Flux.2 klein fast tests (tests/pipelines/flux2): a `Flux2Transformer2DModel` with
one double- and one single-stream block, head dim 16 and four RoPE axes (4, 4, 4, 4); an `AutoencoderKLFlux2`
whose latents are patchified 2x2 and normalised by its batch-norm statistics; a `Qwen3ForCausalLM` text encoder.
What is this module's own:

- the text encoder has 28 layers of width 16, so that the pipeline's default `text_encoder_out_layers` (9, 18, 27)
  exist; the transformer's joint_attention_dim is 3 x 16 (the three layers stacked);
- the tokenizer: a byte-level BPE with Qwen's chat tokens (stepserve.tiny.qwen_tokenizer) and a chat template that
  writes what Qwen3's does for one user message with `enable_thinking=False`;
- the VAE's batch-norm running mean and variance are set to values that are not 0 / 1, so that the decoder's
  de-normalisation is exercised;
- the transformer's matrices are redrawn from N(0, 1/fan_in) (LeCun normal), as the tiny Flux.1's;
- `is_distilled` False by default (classifier-free guidance with the empty prompt, as the base klein models);
  `distilled=True` writes a step-distilled one (guidance ignored).

`variant="dev"` writes a Flux2Pipeline folder instead: a guidance-embedding transformer and a
`Mistral3ForConditionalGeneration` text encoder (a 32-layer Mistral of width 16, so that the pipeline's default
layers 10, 20 and 30 exist and none of them is the last, and a one-layer Pixtral vision tower the class requires,
never run). Its `tokenizer` is not a PixtralProcessor: that class needs torchvision, which stepserve does not
depend on. It is a byte-level tokenizer with Mistral's control tokens and a chat template that writes the
pipeline's messages (a system message, then the prompt; contents as lists of text parts) in Mistral's
`[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]` form; Flux2Pipeline and stepserve call its
apply_chat_template exactly as they would the processor's.

A `stepserve.json` narrows the served sizes to 16..64 pixels (default 32x32) and 8 steps by default.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import mistral_tokenizer, qwen_tokenizer

VARIANTS = ("klein", "dev")

LATENT_CHANNELS = 4  # 16 patchified channels (32 / 128 in the real model)
TEXT_WIDTH = 16
TEXT_LAYERS = 28
# Qwen3's chat template, reduced to what Flux2KleinPipeline asks of it: user messages, a generation prompt, and the
# empty think block Qwen3 writes when thinking is off.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# Mistral's chat format reduced to what Flux2Pipeline sends: a system message and user messages whose content is a
# list of {"type": "text", "text": ...} parts (or a plain string), no generation prompt.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[/INST]"
    "{% else %}{{ eos_token }}{% endif %}{% endfor %}")
DEV_TEXT_LAYERS = 32
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                        max_image_seq_len=4096, base_shift=0.5, max_shift=1.15, time_shift_type="exponential")

BENCH_OPTIONS = {"heads": 8, "layers": (2, 2), "default_size": 64}


def build_tiny_flux2(path: str | Path, *, seed: int = 0, heads: int = 2, layers: tuple[int, int] = (1, 1),
                     default_size: int = 32, distilled: bool = False, variant: str = "klein") -> Path:
    """Write a complete Flux.2 pipeline folder with random weights to `path`; returns `path`. `variant`: "klein"
    (Flux2KleinPipeline) or "dev" (Flux2Pipeline); `heads` (of width 16) and `layers` (double-stream,
    single-stream blocks) size the transformer; `default_size`: the served default image side (half to twice it);
    `distilled`: a step-distilled klein (guidance ignored)."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2Transformer2DModel,
    )

    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r}; allowed: {', '.join(VARIANTS)}")
    if distilled and variant != "klein":
        raise ValueError("distilled: only a klein folder is step-distilled; allowed with variant='dev': False")
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer, text_encoder = _dev_text_encoder() if variant == "dev" else _klein_text_encoder()
    torch.manual_seed(seed + 1)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=layers[0], num_single_layers=layers[1],
        attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=3 * TEXT_WIDTH,
        timestep_guidance_channels=256, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=variant == "dev")
    with torch.no_grad():
        for weight in (p for p in transformer.parameters() if p.ndim == 2):
            weight.normal_(0.0, weight.shape[1] ** -0.5)
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLFlux2(
        sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():
        channels = vae.bn.running_mean.shape[0]
        vae.bn.running_mean.copy_(torch.linspace(-0.4, 0.3, channels))
        vae.bn.running_var.copy_(torch.linspace(0.5, 3.0, channels))
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae, text_encoder=text_encoder,
                 tokenizer=tokenizer, transformer=transformer)
    if variant == "dev":
        from diffusers import Flux2Pipeline

        pipe = Flux2Pipeline(**parts)
    else:
        from diffusers import Flux2KleinPipeline

        pipe = Flux2KleinPipeline(**parts, is_distilled=distilled)
    pipe.save_pretrained(path)
    serving = {"height": default_size, "width": default_size, "min_size": default_size // 2,
               "max_size": default_size * 2, "default_steps": 8}
    (path / "stepserve.json").write_text(json.dumps(serving, indent=2) + "\n")
    return path


def _klein_text_encoder():
    """(tokenizer, Qwen3ForCausalLM): 28 layers of width 16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen_tokenizer(CHAT_TEMPLATE)
    return tokenizer, Qwen3ForCausalLM(Qwen3Config(
        hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=TEXT_LAYERS, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=1024)).eval()


def _dev_text_encoder():
    """(tokenizer, Mistral3ForConditionalGeneration): a 32-layer Mistral of width 16 and a one-layer Pixtral
    vision tower (the class builds one; text-only use never runs it)."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    tokenizer = mistral_tokenizer(MISTRAL_CHAT_TEMPLATE)
    text = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=DEV_TEXT_LAYERS,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, sliding_window=None,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=8)
    config = Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))
    return tokenizer, Mistral3ForConditionalGeneration(config).eval()
