"""A random ControlNet for a local SD 1/2, SDXL, SD3, Flux.1 or Qwen-Image pipeline folder, written offline as
diffusers writes one (a folder with config.json and diffusion_pytorch_model.safetensors). For tests and benchmarks:
made from the folder's denoiser (`ControlNetModel.from_unet`, or the family's ControlNet class's `from_transformer`)
with its zero layers given small random weights, so that it changes the image without swamping it; an SD
ControlNet's conditioning embedding scales images down as the folder's VAE does; an inpainting UNet's ControlNet
takes the latents alone (4 channels, as diffusers' ControlNet inpaint pipelines give it), not the UNet's 9."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def build_tiny_controlnet(model: str | Path, out: str | Path, *, seed: int = 0, std: float = 0.02,
                          depth: tuple[int, ...] | None = None) -> Path:
    """Write the ControlNet folder `out` for the pipeline folder `model` ("embedded" or a path); return it.
    `depth`: a Flux ControlNet's (num_layers, num_single_layers) or a Qwen-Image one's (num_layers,), the
    transformer's unless given; an SD3 one's (num_layers,), unless given all but the transformer's last block
    (which takes no ControlNet output)."""
    from ..pipelines.folder import resolve_model_path

    folder = Path(resolve_model_path(str(model)))
    kind = json.loads((folder / "model_index.json").read_text())["_class_name"]
    build = {"StableDiffusion3Pipeline": _sd3, "QwenImagePipeline": _qwenimage}.get(kind)
    if build is None:  # Flux.1 (a transformer) or SD 1/2 / SDXL (a UNet)
        build = _flux if (folder / "transformer").is_dir() else lambda f, _: _unet(f)
    controlnet, zeroed = build(folder, depth)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in zeroed:
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    controlnet.save_pretrained(out)
    return Path(out)


def _unet(folder: Path):
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(folder / "unet")
    if unet.config.in_channels != unet.config.out_channels:  # an inpainting UNet: its ControlNet takes the latents
        plain = UNet2DConditionModel.from_config({**unet.config, "in_channels": unet.config.out_channels})
        plain.load_state_dict({k: v for k, v in unet.state_dict().items() if not k.startswith("conv_in.")},
                              strict=False)
        unet = plain
    vae = json.loads((folder / "vae" / "config.json").read_text())
    steps = len(vae["block_out_channels"])  # the VAE scales down 2 ** (steps - 1)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32, 32, 64)[:steps])
    return controlnet, [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                        controlnet.controlnet_cond_embedding.conv_out]


def _flux(folder: Path, depth: tuple[int, int] | None):
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    c = transformer.config
    layers, single = depth or (c.num_layers, c.num_single_layers)
    controlnet = FluxControlNetModel.from_transformer(
        transformer, num_layers=layers, num_single_layers=single,
        attention_head_dim=c.attention_head_dim, num_attention_heads=c.num_attention_heads)
    return controlnet, [*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks,
                        controlnet.controlnet_x_embedder]


def _sd3(folder: Path, depth: tuple[int] | None):
    from diffusers import SD3ControlNetModel, SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(folder / "transformer")
    layers = (depth or (max(1, transformer.config.num_layers - 1),))[0]
    controlnet = SD3ControlNetModel.from_transformer(transformer, num_layers=layers, num_extra_conditioning_channels=0)
    return controlnet, [*controlnet.controlnet_blocks, controlnet.pos_embed_input]


def _qwenimage(folder: Path, depth: tuple[int] | None):
    from diffusers import QwenImageControlNetModel, QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel.from_pretrained(folder / "transformer")
    c = transformer.config
    controlnet = QwenImageControlNetModel.from_transformer(
        transformer, num_layers=(depth or (c.num_layers,))[0], attention_head_dim=c.attention_head_dim,
        num_attention_heads=c.num_attention_heads)
    return controlnet, [*controlnet.controlnet_blocks, controlnet.controlnet_x_embedder]
