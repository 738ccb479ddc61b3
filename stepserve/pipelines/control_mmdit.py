"""What the MMDiT families give their ControlNets (stepserve/controls): SD3's and Qwen-Image's mixins, beside
control_inputs.py's (which says what a family's mixin provides).

SD3 (diffusers' StableDiffusion3ControlNetPipeline with SD3ControlNetModel): the control image is VAE-encoded at the
request's size; the ControlNet is a small MMDiT that takes the row's latents, timestep and text, adds the image's
patches to its own, and gives one output per block, which the transformer adds to its blocks' hidden states
(`block_controlnet_hidden_states`). With classifier-free guidance it runs on both rows.

Qwen-Image (QwenImageControlNetPipeline with QwenImageControlNetModel): the control image VAE-encoded, normalised
and packed as the latents are; the ControlNet's outputs go to the transformer as `controlnet_block_samples`. With
true CFG the pipeline runs the ControlNet once, on the prompt, and both forwards take its outputs: the family says
so (`controls_from_conditional_row`), and the executor gives the unconditional row its conditional row's outputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .control_inputs import _differs, _processor


class SD3Controls:
    """SD3 / SD3.5: diffusers' SD3ControlNetModel (InstantX's and Stability's SD3 ControlNets). The pipeline samples
    the control image's latents from torch's global generator, each row of a guided request its own sample; here
    they come from a generator seeded with the request's seed (the same values as the pipeline after
    `torch.manual_seed(seed)`), drawn per control in the request's order: the unconditional row's first, then the
    conditional row's."""

    @staticmethod
    def controlnet_class():
        from diffusers import SD3ControlNetModel

        return SD3ControlNetModel

    def control_problems(self, config: dict) -> list[str]:
        if config.get("_class_name") != "SD3ControlNetModel":
            return [f"it is a {config.get('_class_name')}, not an SD3ControlNetModel"]
        tr = self.networks.transformer.config
        inner = (config.get("num_attention_heads") or 0) * (config.get("attention_head_dim") or 0)
        own = tr.num_attention_heads * tr.attention_head_dim
        text = config.get("joint_attention_dim", tr.joint_attention_dim)
        reach = config.get("pos_embed_max_size") or 0
        return [
            "it shares the transformer's position embedding (use_pos_embed false, as SD3.5 Large's ControlNets: not "
            "served; allowed: ControlNets with a position embedding of their own)"
            if config.get("use_pos_embed", True) is False else "",
            "it takes no text (joint_attention_dim null, as SD3.5 Large's ControlNets: not served)"
            if text is None else "",
            f"it takes {config['extra_conditioning_channels']} extra conditioning channels (an inpainting "
            "ControlNet's mask: not served; allowed: extra_conditioning_channels 0)"
            if config.get("extra_conditioning_channels") else "",
            "it is a union ControlNet (num_mode: control_mode is not served)" if config.get("num_mode") else "",
            _differs("transformer", config, "in_channels", tr.in_channels),
            _differs("transformer", config, "patch_size", tr.patch_size),
            f"its width {inner} is not the transformer's {own}" if inner != own else "",
            _differs("transformer", config, "joint_attention_dim", tr.joint_attention_dim) if text is not None else "",
            _differs("transformer", config, "pooled_projection_dim", tr.pooled_projection_dim),
            f"its position embedding covers {reach} patches a side, the transformer's {tr.pos_embed_max_size}"
            if tr.pos_embed_max_size and reach < tr.pos_embed_max_size else "",
        ]

    def control_generator(self, params, generator):
        """The pipeline samples the control latents from torch's global generator, not the request's (whose first
        draw is the noise): a generator of their own, seeded with the request's seed."""
        return torch.Generator("cpu").manual_seed(params.seed)

    @torch.no_grad()
    def control_image(self, image, params, generator) -> Tensor | tuple[Tensor, Tensor]:
        """StableDiffusion3ControlNetPipeline: the image preprocessed to [-1, 1] at the request's size, repeated for
        both rows when guided, VAE-encoded and sampled (one sample per row), times the VAE's scaling factor (the
        shift is the ControlNet's: control_forward). Guided: (the conditional row's, the unconditional row's)."""
        pixels = _processor(self.vae_scale_factor).preprocess(image, height=params.height, width=params.width)
        rows = 2 if params.guidance_scale > 1 else 1
        pixels = pixels.to(self.device, self.dtype).repeat(rows, 1, 1, 1)
        latents = self.networks.vae.encode(pixels).latent_dist.sample(generator) * self.vae_scaling_factor
        latents = latents.to(self.dtype)
        return (latents[1:], latents[:1]) if rows == 2 else latents

    def control_forward(self, net, sample: Tensor, timestep: Tensor, conditioning: dict, images: Tensor) -> dict:
        """force_zeros_for_pooled_projection (SD3 ControlNets' default): the ControlNet takes zero pooled
        projections and the image latents unshifted; otherwise the row's pooled projections and the latents shifted
        by the VAE's shift_factor, as the pipeline does (it reads the first ControlNet's config for all of them;
        here each ControlNet's own counts)."""
        pooled = conditioning["pooled_projections"]
        if net.config.force_zeros_for_pooled_projection:
            pooled = torch.zeros_like(pooled)
        else:
            images = images - self.vae_shift_factor * self.vae_scaling_factor
        (blocks,) = net(hidden_states=sample, controlnet_cond=images, conditioning_scale=1.0,
                        encoder_hidden_states=conditioning["encoder_hidden_states"], pooled_projections=pooled,
                        timestep=timestep, return_dict=False)
        return {"block_controlnet_hidden_states": tuple(blocks)}


class QwenImageControls:
    """Qwen-Image: diffusers' QwenImageControlNetModel (InstantX's Qwen-Image ControlNets). The pipeline's multi
    model (QwenImageMultiControlNetModel) runs one ControlNet on several images; here several ControlNets of the
    same depth add up as well."""

    controls_from_conditional_row = True

    @staticmethod
    def controlnet_class():
        from diffusers import QwenImageControlNetModel

        return QwenImageControlNetModel

    def control_problems(self, config: dict) -> list[str]:
        if config.get("_class_name") != "QwenImageControlNetModel":
            return [f"it is a {config.get('_class_name')}, not a QwenImageControlNetModel"]
        tr = self.networks.transformer.config
        inner = (config.get("num_attention_heads") or 0) * (config.get("attention_head_dim") or 0)
        own = tr.num_attention_heads * tr.attention_head_dim
        return [
            f"it takes {config['extra_condition_channels']} extra condition channels (an inpainting ControlNet's "
            "mask: not served; allowed: extra_condition_channels 0)" if config.get("extra_condition_channels") else "",
            _differs("transformer", config, "in_channels", tr.in_channels),
            _differs("transformer", config, "patch_size", tr.patch_size),
            f"its width {inner} is not the transformer's {own}" if inner != own else "",
            _differs("transformer", config, "joint_attention_dim", tr.joint_attention_dim),
            _differs("transformer", config, "axes_dims_rope", tr.axes_dims_rope),
        ]

    @torch.no_grad()
    def control_image(self, image, params, generator) -> Tensor:
        """QwenImageControlNetPipeline: the image preprocessed to [-1, 1] at the request's size, VAE-encoded as one
        frame (sampled with the request's generator, before its noise is drawn), normalised per channel
        ((x - latents_mean) / latents_std) and packed."""
        pixels = _processor(self.vae_scale_factor * 2).preprocess(image, height=params.height, width=params.width)
        vae = self.networks.vae
        latents = vae.encode(pixels.to(self.device, vae.dtype)[:, :, None]).latent_dist.sample(generator)
        latents = (latents - self.latents_mean.to(latents.dtype)) * self.latents_inv_std.to(latents.dtype)
        return self.pack_latents(latents[:, :, 0]).to(self.dtype)

    def control_forward(self, net, sample: Tensor, timestep: Tensor, conditioning: dict, images: Tensor) -> dict:
        shape = conditioning["img_shape"]
        blocks = net(hidden_states=sample, controlnet_cond=images, conditioning_scale=1.0,
                     timestep=timestep.to(sample.dtype) / 1000,
                     encoder_hidden_states=conditioning["encoder_hidden_states"],
                     encoder_hidden_states_mask=conditioning.get("encoder_hidden_states_mask"),
                     img_shapes=[tuple(int(v) for v in shape[0].tolist())] * sample.shape[0], return_dict=False)
        return {"controlnet_block_samples": tuple(blocks)}
