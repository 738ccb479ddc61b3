"""A Stable Diffusion 1/2 diffusers folder written as one whole-model checkpoint in the original (LDM) key layout,
as community sites and A1111 / ComfyUI setups keep them: the UNet under `model.diffusion_model.`, the VAE under
`first_stage_model.`, the CLIP text encoder under `cond_stage_model.transformer.`. It is the test input for
`--model FILE.safetensors --config DIR`, which diffusers' `from_single_file` reads back.

The key map is the inverse of the layout diffusers' converters read (`convert_ldm_unet_checkpoint`,
`convert_ldm_vae_checkpoint`), for any number of levels and layers per block; the test that loads the file back
checks it against diffusers' own reading.
"""

from __future__ import annotations

import json
from pathlib import Path

RESNET = [("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"), ("out_layers.3", "conv2"),
          ("emb_layers.1", "time_emb_proj"), ("skip_connection", "conv_shortcut")]
VAE_RESNET = [("nin_shortcut", "conv_shortcut")]
VAE_ATTENTION = [("norm", "group_norm"), ("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0")]


def unet_prefixes(config: dict) -> list[tuple[str, str]]:
    """(LDM prefix, diffusers prefix) pairs of a UNet2DConditionModel config."""
    layers, levels = config["layers_per_block"], len(config["block_out_channels"])
    down, up = config["down_block_types"], config["up_block_types"]
    pairs = [("time_embed.0.", "time_embedding.linear_1."), ("time_embed.2.", "time_embedding.linear_2."),
             ("input_blocks.0.0.", "conv_in."), ("out.0.", "conv_norm_out."), ("out.2.", "conv_out."),
             ("middle_block.0.", "mid_block.resnets.0."), ("middle_block.1.", "mid_block.attentions.0."),
             ("middle_block.2.", "mid_block.resnets.1.")]
    for i in range(levels):
        for j in range(layers):
            block = 1 + i * (layers + 1) + j
            pairs.append((f"input_blocks.{block}.0.", f"down_blocks.{i}.resnets.{j}."))
            if "CrossAttn" in down[i]:
                pairs.append((f"input_blocks.{block}.1.", f"down_blocks.{i}.attentions.{j}."))
        if i < levels - 1:
            pairs.append((f"input_blocks.{(i + 1) * (layers + 1)}.0.op.", f"down_blocks.{i}.downsamplers.0.conv."))
        for j in range(layers + 1):
            block = i * (layers + 1) + j
            pairs.append((f"output_blocks.{block}.0.", f"up_blocks.{i}.resnets.{j}."))
            if "CrossAttn" in up[i]:
                pairs.append((f"output_blocks.{block}.1.", f"up_blocks.{i}.attentions.{j}."))
        if i < levels - 1:
            where = 2 if "CrossAttn" in up[i] else 1
            pairs.append((f"output_blocks.{i * (layers + 1) + layers}.{where}.conv.",
                          f"up_blocks.{i}.upsamplers.0.conv."))
    return pairs


def vae_prefixes(config: dict) -> list[tuple[str, str]]:
    levels, layers = len(config["block_out_channels"]), config["layers_per_block"]
    pairs = [("encoder.norm_out.", "encoder.conv_norm_out."), ("decoder.norm_out.", "decoder.conv_norm_out.")]
    for part in ("encoder", "decoder"):
        pairs += [(f"{part}.mid.block_1.", f"{part}.mid_block.resnets.0."),
                  (f"{part}.mid.attn_1.", f"{part}.mid_block.attentions.0."),
                  (f"{part}.mid.block_2.", f"{part}.mid_block.resnets.1.")]
    for i in range(levels):
        for j in range(layers):
            pairs.append((f"encoder.down.{i}.block.{j}.", f"encoder.down_blocks.{i}.resnets.{j}."))
        if i < levels - 1:
            pairs.append((f"encoder.down.{i}.downsample.", f"encoder.down_blocks.{i}.downsamplers.0."))
        for j in range(layers + 1):
            pairs.append((f"decoder.up.{levels - 1 - i}.block.{j}.", f"decoder.up_blocks.{i}.resnets.{j}."))
        if i < levels - 1:
            pairs.append((f"decoder.up.{levels - 1 - i}.upsample.", f"decoder.up_blocks.{i}.upsamplers.0."))
    return pairs


def _rename(key: str, prefixes: list[tuple[str, str]], inner: list[tuple[str, str]]) -> str:
    for ldm, hf in sorted(prefixes, key=lambda p: -len(p[1])):
        if key.startswith(hf):
            rest = key[len(hf):]
            for old, new in inner:
                if rest.startswith(new + "."):
                    rest = old + rest[len(new):]
            return ldm + rest
    return key


def ldm_state(folder: str | Path) -> dict:
    """The folder's UNet, VAE and text encoder as one LDM-layout state dict (float32)."""
    from .single_file import denoiser_state

    folder = Path(folder)
    unet_config = json.loads((folder / "unet" / "config.json").read_text())
    vae_config = json.loads((folder / "vae" / "config.json").read_text())
    state = {}
    for key, value in denoiser_state(folder, "unet").items():
        state["model.diffusion_model." + _rename(key, unet_prefixes(unet_config), RESNET)] = value
    for key, value in denoiser_state(folder, "vae").items():
        name = _rename(key, vae_prefixes(vae_config), VAE_RESNET)
        if ".mid.attn_1." in name:
            name = _rename_attention(name)
            if value.ndim == 2:  # LDM's VAE attention projections are 1x1 convolutions
                value = value[:, :, None, None]
        state["first_stage_model." + name] = value
    for key, value in denoiser_state(folder, "text_encoder").items():  # transformers' CLIPTextModel, which
        key = key if key.startswith("text_model.") else "text_model." + key  # newer versions save flattened
        state["cond_stage_model.transformer." + key] = value
    return state


def _rename_attention(name: str) -> str:
    head, _, rest = name.partition(".mid.attn_1.")
    for old, new in VAE_ATTENTION:
        if rest.startswith(new + "."):
            return f"{head}.mid.attn_1.{old}{rest[len(new):]}"
    return name


def write_ldm_file(folder: str | Path, out: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in ldm_state(folder).items()}, str(out))
    return out
