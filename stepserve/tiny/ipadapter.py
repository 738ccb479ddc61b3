"""A random IP-Adapter for a local SD 1/2 or SDXL pipeline folder, written offline in the layout diffusers'
`load_ip_adapter(folder, subfolder=name, weight_name=WEIGHTS)` reads: `out/ip-adapter.safetensors` (the image
projection as `image_proj.*`, each cross-attention's image key and value as `ip_adapter.{k}.to_k_ip/to_v_ip`, k =
1, 3, 5, ... in the UNet's order of attention processors) and `out/image_encoder/` (a tiny random
CLIPVisionModelWithProjection). For tests and trying the server offline: it changes the image, not usefully."""

from __future__ import annotations

from pathlib import Path

import torch

WEIGHTS = "ip-adapter.safetensors"


def build_tiny_ip_adapter(model: str | Path, out: str | Path, *, seed: int = 0, std: float = 0.05,
                          embed_dim: int = 16, encoder_seed: int | None = None) -> Path:
    """Write the IP-Adapter folder `out` for the pipeline folder `model` ("embedded" or a path); return it.
    `encoder_seed` (default `seed`): adapters built with the same one share their image encoder, as several
    adapters loaded together into one diffusers pipeline must (it keeps the first one's encoder)."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    from ..pipelines.folder import resolve_model_path

    out = Path(out)
    unet = UNet2DConditionModel.from_pretrained(Path(resolve_model_path(str(model))) / "unet")
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * scale

    cross = unet.config.cross_attention_dim
    tensors = {"image_proj.proj.weight": rand(4 * cross, embed_dim, scale=0.3),
               "image_proj.proj.bias": rand(4 * cross, scale=0.3),
               "image_proj.norm.weight": 1 + rand(cross), "image_proj.norm.bias": rand(cross)}
    key = 1
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):  # the cross-attentions, as diffusers numbers them
            attn = unet.get_submodule(name.rsplit(".", 1)[0])
            for kind in ("to_k_ip", "to_v_ip"):
                tensors[f"ip_adapter.{key}.{kind}.weight"] = rand(attn.to_k.out_features, cross)
            key += 2
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS))
    torch.manual_seed(seed if encoder_seed is None else encoder_seed)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, image_size=32,
        patch_size=8, projection_dim=embed_dim))
    encoder.save_pretrained(out / "image_encoder")
    return out
