"""What each family gives its ControlNets (stepserve/controls): mixins of the family adapters that serve them.

A family that runs ControlNets says which diffusers class loads one (`controlnet_class`), what in a ControlNet's
config does not fit its denoiser (`control_problems`), how a request's control image is prepared once
(`control_image`, as the family's diffusers ControlNet pipeline prepares it) and how a ControlNet runs on some rows
of a step (`control_forward`: the rows' sample, timesteps, collated conditioning and control images -> the
denoiser's control keywords, each a tensor or a tuple of tensors with the rows on dim 0). stepserve/controls/rows.py
weights and sums them per row; the denoiser's one forward takes them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _processor(vae_scale_factor: int, **options):
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=vae_scale_factor, **options)


def _differs(what: str, config: dict, key: str, own) -> str:
    value = config.get(key)
    value = list(value) if isinstance(value, (list, tuple)) else value
    own = list(own) if isinstance(own, (list, tuple)) else own
    return f"its {key} {value} is not the {what}'s {own}" if value != own else ""


class UNetControls:
    """SD 1/2 and SDXL: diffusers' ControlNetModel beside the UNet (StableDiffusionControlNetPipeline,
    StableDiffusionXLControlNetPipeline). SDXL's ControlNet takes the row's added conditions (text_embeds,
    time_ids) as the UNet does."""

    @staticmethod
    def controlnet_class():
        from diffusers import ControlNetModel

        return ControlNetModel

    def control_problems(self, config: dict) -> list[str]:
        """Why a ControlNet config does not fit this UNet ([] when it does)."""
        if config.get("_class_name") != "ControlNetModel":
            return [f"it is a {config.get('_class_name')}, not a ControlNetModel"]
        unet = self.networks.unet.config
        downs = 2 ** (len(config.get("conditioning_embedding_out_channels", (16, 32, 96, 256))) - 1)
        added = config.get("addition_embed_type")
        return [
            ("it is made for SDXL (added text and time embeddings)" if added else
             "it is made for SD 1/2 (no added text and time embeddings)") if added != unet.addition_embed_type else "",
            _differs("UNet", config, "projection_class_embeddings_input_dim",
                     unet.projection_class_embeddings_input_dim) if added and added == unet.addition_embed_type
            else "",
            _differs("latents", config, "in_channels", unet.out_channels),  # an inpainting UNet's too (not its 9)
            _differs("UNet", config, "cross_attention_dim", unet.cross_attention_dim),
            _differs("UNet", config, "block_out_channels", unet.block_out_channels),
            f"its conditioning embedding scales images down {downs}x, the VAE {self.vae_scale_factor}x"
            if downs != self.vae_scale_factor else "",
        ]

    @staticmethod
    def guess_scales(net, count: int) -> list[float]:
        """Guess mode's weight of each of a ControlNet's `count` outputs (down blocks, then mid), as
        ControlNetModel.forward(guess_mode=True) scales them: a logspace from 0.1 to 1.0; all 1 for a ControlNet
        that pools its conditions (global_pool_conditions: the model only pools them)."""
        if net.config.global_pool_conditions:
            return [1.0] * count
        return torch.logspace(-1, 0, count).tolist()

    def control_image(self, image, params, generator) -> Tensor:
        """StableDiffusion(XL)ControlNetPipeline.prepare_image: resized to the request's size, RGB, [0, 1] floats
        (no normalisation); (1, 3, H, W) on the device in the pipeline's dtype."""
        processor = _processor(self.vae_scale_factor, do_convert_rgb=True, do_normalize=False)
        pixels = processor.preprocess(image, height=params.height, width=params.width)
        return pixels.to(dtype=torch.float32).to(self.device, self.dtype)

    def control_forward(self, net, sample: Tensor, timestep: Tensor, conditioning: dict, images: Tensor) -> dict:
        added = {k: conditioning[k] for k in ("text_embeds", "time_ids") if k in conditioning}  # SDXL's
        down, mid = net(sample, timestep, conditioning["encoder_hidden_states"], controlnet_cond=images,
                        conditioning_scale=1.0, added_cond_kwargs=added or None, return_dict=False)
        return {"down_block_additional_residuals": tuple(down), "mid_block_additional_residual": mid}

    @staticmethod
    def control_outputs(net) -> int:
        """How many outputs control_forward gives: one per down-block skip, then the mid block's."""
        return len(net.controlnet_down_blocks) + 1

    @torch.no_grad()
    def control_forward_shallow(self, net, sample: Tensor, timestep: Tensor, conditioning: dict,
                                images: Tensor) -> dict:
        """control_forward's first outputs only, for rows that reuse the UNet's deep part at this step (step
        caching, caching/unet.py): the residuals of the skips the UNet's last up block takes (conv_in's and the
        first down block's resnets'). ControlNetModel.forward's own operations up to its first down block, so each
        equals that output of the whole forward; the rest of the ControlNet does not run."""
        keep = len(self.networks.unet.up_blocks[-1].resnets)
        c = net.config
        if net.class_embedding is not None or c.addition_embed_type not in (None, "text_time"):
            down = self.control_forward(net, sample, timestep, conditioning, images)["down_block_additional_residuals"]
            return {"down_block_additional_residuals": down[:keep]}
        if c.controlnet_conditioning_channel_order == "bgr":
            images = torch.flip(images, dims=[1])
        timesteps = (timestep if timestep.dim() else timestep[None]).expand(sample.shape[0])
        emb = net.time_embedding(net.time_proj(timesteps).to(dtype=sample.dtype), None)
        if c.addition_embed_type == "text_time":  # SDXL's added text and time embeddings
            text_embeds = conditioning["text_embeds"]
            time_embeds = net.add_time_proj(conditioning["time_ids"].flatten()).reshape((text_embeds.shape[0], -1))
            emb = emb + net.add_embedding(torch.concat([text_embeds, time_embeds], dim=-1).to(emb.dtype))
        h = net.conv_in(sample) + net.controlnet_cond_embedding(images)
        block = net.down_blocks[0]
        if getattr(block, "has_cross_attention", False):
            _, more = block(hidden_states=h, temb=emb, encoder_hidden_states=conditioning["encoder_hidden_states"])
        else:
            _, more = block(hidden_states=h, temb=emb)
        out = tuple(zero(r) for r, zero in zip(((h,) + more)[:keep], net.controlnet_down_blocks))
        if c.global_pool_conditions:
            out = tuple(torch.mean(r, dim=(2, 3), keepdim=True) for r in out)
        return {"down_block_additional_residuals": out}


class FluxControls:
    """Flux.1: diffusers' FluxControlNetModel (FluxControlNetPipeline; InstantX's kind: the control image
    VAE-encoded and packed as the latents are). Its outputs are added inside the transformer's double- and
    single-stream blocks (controlnet_block_samples, controlnet_single_block_samples)."""

    @staticmethod
    def controlnet_class():
        from diffusers import FluxControlNetModel

        return FluxControlNetModel

    def control_problems(self, config: dict) -> list[str]:
        if config.get("_class_name") != "FluxControlNetModel":
            return [f"it is a {config.get('_class_name')}, not a FluxControlNetModel"]
        tr = self.networks.transformer.config
        inner = (config.get("num_attention_heads") or 0) * (config.get("attention_head_dim") or 0)
        return [
            "it is a union ControlNet (num_mode: control_mode is not served)" if config.get("num_mode") else "",
            "it takes the image through an input hint block (conditioning_embedding_channels: not served; allowed: "
            "ControlNets that take the VAE-encoded image)" if config.get("conditioning_embedding_channels") else "",
            _differs("transformer", config, "in_channels", tr.in_channels),
            f"its width {inner} is not the transformer's {tr.num_attention_heads * tr.attention_head_dim}"
            if inner != tr.num_attention_heads * tr.attention_head_dim else "",
            _differs("transformer", config, "joint_attention_dim", tr.joint_attention_dim),
            _differs("transformer", config, "pooled_projection_dim", tr.pooled_projection_dim),
            _differs("transformer", config, "guidance_embeds", tr.guidance_embeds),
            _differs("transformer", config, "axes_dims_rope", tr.axes_dims_rope),
        ]

    @torch.no_grad()
    def control_image(self, image, params, generator) -> Tensor:
        """FluxControlNetPipeline: the image preprocessed to [-1, 1] at the request's size, VAE-encoded (sampled
        with the request's generator, before its noise is drawn, as the pipeline does), shifted, scaled, packed."""
        pixels = _processor(self.vae_scale_factor * 2).preprocess(image, height=params.height, width=params.width)
        latents = self.networks.encode_image(pixels.to(self.device, self.dtype), generator)
        return self.pack_latents(latents.to(self.dtype))

    def control_forward(self, net, sample: Tensor, timestep: Tensor, conditioning: dict, images: Tensor) -> dict:
        embeds = conditioning["encoder_hidden_states"]
        double, single = net(
            hidden_states=sample, controlnet_cond=images, conditioning_scale=1.0,
            timestep=timestep.to(sample.dtype) / 1000,
            guidance=conditioning.get("guidance"),  # the transformer's: the same guidance_embeds
            pooled_projections=conditioning["pooled_projections"], encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=sample.device, dtype=self.dtype),
            img_ids=conditioning["img_ids"][0], return_dict=False)
        return {"controlnet_block_samples": tuple(double), "controlnet_single_block_samples": tuple(single or ())}
