"""A random LoRA adapter for a local pipeline folder's denoiser, written offline as diffusers writes one
(`save_lora_weights`: a safetensors file in diffusers' PEFT naming, with the ranks and alphas it was made with).
For tests and benchmarks: its weights are random, its shapes those of the folder's UNet or transformer."""

from __future__ import annotations

from pathlib import Path

import torch

# the denoiser's sub-folder, its class and the pipeline class whose save_lora_weights writes the file
_FAMILIES = {
    "StableDiffusionPipeline": ("unet", "UNet2DConditionModel", "unet_lora_layers"),
    "StableDiffusionXLPipeline": ("unet", "UNet2DConditionModel", "unet_lora_layers"),
    "FluxPipeline": ("transformer", "FluxTransformer2DModel", "transformer_lora_layers"),
    "StableDiffusion3Pipeline": ("transformer", "SD3Transformer2DModel", "transformer_lora_layers"),
    "QwenImagePipeline": ("transformer", "QwenImageTransformer2DModel", "transformer_lora_layers"),
    "Flux2KleinPipeline": ("transformer", "Flux2Transformer2DModel", "transformer_lora_layers"),
    "Flux2Pipeline": ("transformer", "Flux2Transformer2DModel", "transformer_lora_layers"),
}
DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def build_tiny_lora(model: str | Path, out: str | Path, *, seed: int = 0, rank: int = 4, alpha: float | None = None,
                    targets: tuple[str, ...] = DEFAULT_TARGETS, std: float = 0.05,
                    text_encoder: bool = False) -> Path:
    """Write `out` (a .safetensors file) for the pipeline folder `model` ("embedded" or a path); return it. Both
    low-rank factors are random normal with `std`, so the adapter changes the image visibly. `text_encoder`: adapt
    the (first) text encoder's attention projections too."""
    import json

    import diffusers
    from peft import LoraConfig

    from ..pipelines.folder import resolve_model_path

    folder = Path(resolve_model_path(str(model)))
    pipeline_class = json.loads((folder / "model_index.json").read_text())["_class_name"]
    if pipeline_class not in _FAMILIES:
        raise ValueError(f"{pipeline_class}: no LoRA builder; allowed: {', '.join(_FAMILIES)}")
    sub, model_class, argument = _FAMILIES[pipeline_class]
    gen = torch.Generator().manual_seed(seed)
    config = dict(r=rank, lora_alpha=alpha if alpha is not None else rank, init_lora_weights=False)
    net = getattr(diffusers, model_class).from_pretrained(folder / sub)
    parts = {argument: _random_adapter(net, LoraConfig(target_modules=list(targets), **config), gen, std)}
    if text_encoder:
        import transformers

        te_class = json.loads((folder / "model_index.json").read_text())["text_encoder"][1]
        te = getattr(transformers, te_class).from_pretrained(folder / "text_encoder")
        parts["text_encoder_lora_layers"] = _random_adapter(
            te, LoraConfig(target_modules=["q_proj", "k_proj", "v_proj", "out_proj"], **config), gen, std)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    getattr(diffusers, pipeline_class).save_lora_weights(out.parent, **parts, weight_name=out.name,
                                                         safe_serialization=True)
    return out


def _random_adapter(module, config, gen: torch.Generator, std: float) -> dict:
    """`module` with a PEFT adapter of `config`, its low-rank factors random normal; its state dict."""
    from peft import inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    if hasattr(module, "add_adapter") and not hasattr(module, "get_input_embeddings"):  # a diffusers model
        module.add_adapter(config)
    else:
        module = inject_adapter_in_model(config, module)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return get_peft_model_state_dict(module)
