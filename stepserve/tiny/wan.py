"""A tiny random Wan 2.1 / 2.2 text-to-video pipeline (diffusers `WanPipeline`), built offline and saved as a
diffusers folder.

The shapes follow diffusers' own Wan fast tests (tests/pipelines/wan): a `WanTransformer3DModel` with two blocks
of two heads of width 12 and (1, 2, 2) patches; an `AutoencoderKLWan` of base width 3 whose latents are 8x smaller
in height and width and 4x shorter in time (frames 1 + 4k -> 1 + k latent frames), and a `UMT5EncoderModel` of
width 32. What is this module's own:

- the tokenizer: a T5 (Unigram) tokenizer over single printable characters and the word-start marker, built in
  memory (the real umt5-xxl vocabulary is not downloaded);
- 4 latent channels (16 in Wan) with per-channel `latents_mean` / `latents_std` that are not 0 / 1, so that the
  decoder's de-normalisation is exercised;
- the scheduler config of the real Wan 2.1 T2V 1.3B (`UniPCMultistepScheduler` in flow mode with flow_shift 3.0):
  stepserve serves it with its flow samplers (pipelines/wan.py);
- the transformer's matrices redrawn from N(0, 1/fan_in) (LeCun normal), as the tiny Flux's: with the default init
  a random transformer this small barely listens to its text;
- `wan22=True`: a Wan 2.2 A14B-style folder, a second transformer (`transformer_2`, the low-noise expert) and a
  `boundary_ratio` (0.875 as Wan 2.2 T2V) in model_index.json.

A `stepserve.json` narrows the served sizes to 16..64 pixels (default 32x32), frames to at most 9 (default 5) and
8 steps by default, so the tiny model stays cheap to serve. Nothing is downloaded.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

LATENT_CHANNELS = 4
TEXT_WIDTH = 32  # = the transformer's text_dim (4096 in Wan)
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers' scheduler/scheduler_config.json (UniPC in flow mode)
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                        flow_shift=3.0, solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True,
                        final_sigmas_type="zero", timestep_spacing="linspace")
BOUNDARY_RATIO = 0.875  # Wan 2.2 T2V A14B's model_index.json

# The size benchmarks use: a wider transformer at 64x64, 9 frames.
BENCH_OPTIONS = {"heads": 4, "layers": 4, "default_size": 64, "default_frames": 9}


def t5_tokenizer():
    """A T5 tokenizer (Unigram) whose pieces are single printable characters, each also with the word-start marker
    '▁' (one token per character), built offline."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for c in (c for c in string.printable if not c.isspace()):
        pieces += [(c, -3.0), ("▁" + c, -2.5)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _tiny_transformer(heads: int, layers: int):
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=12, in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS, text_dim=TEXT_WIDTH, freq_dim=32, ffn_dim=32, num_layers=layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    with torch.no_grad():
        for weight in (p for p in transformer.parameters() if p.ndim == 2):
            weight.normal_(0.0, weight.shape[1] ** -0.5)
    return transformer


def build_tiny_wan(path: str | Path, *, seed: int = 0, heads: int = 2, layers: int = 2, default_size: int = 32,
                   default_frames: int = 5, wan22: bool = False) -> Path:
    """Write a complete WanPipeline folder with random weights to `path`; returns `path`. `heads` (of width 12)
    and `layers` size the transformer(s); `default_size`: the served default side (half to twice it);
    `default_frames`: the videos endpoint's default length (frames up to twice it less one); `wan22`: two
    transformers and a boundary_ratio (Wan 2.2)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path)
    tokenizer = t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=32, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0)).eval()
    torch.manual_seed(seed + 1)
    transformer = _tiny_transformer(heads, layers)
    transformer_2 = None
    if wan22:
        torch.manual_seed(seed + 3)
        transformer_2 = _tiny_transformer(heads, layers)
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(base_dim=3, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[-0.3, 0.1, 0.25, -0.05],
                           latents_std=[1.6, 2.2, 1.9, 2.6])
    scheduler = UniPCMultistepScheduler(**SCHEDULER_CONFIG)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, transformer_2=transformer_2,
                       boundary_ratio=BOUNDARY_RATIO if wan22 else None)
    pipe.save_pretrained(path)
    serving = {"height": default_size, "width": default_size, "min_size": default_size // 2,
               "max_size": default_size * 2, "default_steps": 8, "default_frames": default_frames,
               "max_frames": 2 * default_frames - 1}
    (path / "stepserve.json").write_text(json.dumps(serving, indent=2) + "\n")
    return path
