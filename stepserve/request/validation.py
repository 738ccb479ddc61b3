"""Checking and resolving what a caller asked for. Every error names the field and what is allowed."""

from __future__ import annotations

import math
import re
import secrets
from typing import NamedTuple

from ..caching.spec import CacheSpecError, parse_cache
from ..controls.spec import ControlSpecError
from ..ipadapter.spec import IPAdapterSpecError
from ..capabilities import capabilities, served_for
from .control_params import resolve_controls
from .image_prompt import resolve_ip_adapter
from ..lora.spec import LoraSpecError, parse_loras
from .img2img_spec import first_step, is_valid_strength
from .types import ModelInfo, ResolvedParams, SamplingParams

MAX_SEED = 2**63 - 1  # largest seed a caller may give (docs/HTTP_API.md); torch generators take up to 2**64-1
DRAWN_SEED_LIMIT = 2**31  # a seed drawn for a request that has none lies in [0, DRAWN_SEED_LIMIT)
MIN_PRIORITY, MAX_PRIORITY = -100, 100  # SamplingParams.priority: an integer in this range, higher served first
_GUIDANCE_MEANING = {"cfg": "<= 1 disables guidance", "embedded": "the value fed to the model's guidance embedding"}
_SIZE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")


class ValidationError(ValueError):
    """Bad input. `field` names the offending field; the message says what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class SizeError(ValidationError):
    """A width x height the model cannot make. `field` is the first wrong side ("height" or "width"); the message
    names the whole requested size, what is wrong with it and which sizes are allowed. The HTTP API, whose callers
    give one "size", words it as `about_size()`."""

    def __init__(self, field: str, width: object, height: object, problem: str, allowed: str) -> None:
        self.requested = f"{width}x{height}"
        self.problem = problem  # "" or ": height 33 is not a multiple of 8"
        self.allowed = allowed
        super().__init__(field, f"{self.requested} (width x height) is not supported{problem}; allowed: {allowed}")

    def about_size(self) -> str:
        return f"{self.requested} is not supported{self.problem}; allowed: {self.allowed}"


class Size(NamedTuple):
    width: int
    height: int


def parse_size(size: str) -> Size:
    """'WxH' (width first, as in the HTTP API's "size", e.g. '512x384') -> Size(width, height)."""
    match = _SIZE.match(size) if isinstance(size, str) else None
    if not match:
        raise ValidationError("size", f"expected 'WxH' (width x height) such as '512x384', got {str(size)[:40]!r}")
    return Size(int(match.group(1)), int(match.group(2)))


def draw_seed() -> int:
    """A fresh random seed for a request that did not give one."""
    return secrets.randbelow(DRAWN_SEED_LIMIT)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _size_problem(value: object, model: ModelInfo) -> str | None:
    """What is wrong with one side of a requested size, or None when the model can make it."""
    if not _is_int(value):
        return "is not an integer"
    if not model.min_size <= value <= model.max_size:
        return f"is outside {model.min_size}..{model.max_size}"
    if value % model.size_multiple:
        return f"is not a multiple of {model.size_multiple}"
    return None


def _check_text(field: str, value: str) -> None:
    """Text must encode as UTF-8 (a lone UTF-16 surrogate, e.g. JSON "\\ud800", does not): the tokenizer would
    otherwise fail for every request of the batch."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(field, f"must be valid Unicode text (UTF-8 encodable); character {exc.start} is "
                                     f"{value[exc.start:exc.end]!r}, a lone surrogate") from None


def as_image(field: str, value, mode: str):
    """A PIL image in `mode` ("RGB" for an image, "L" for a mask) from a PIL image or an (H, W[, C]) uint8 array:
    the one place a request's picture is normalised. An image already in `mode` is taken as it is (not copied), so
    a picture normalised where it was received (the HTTP server decodes uploads off its event loop) is converted
    once."""
    from PIL import Image

    if not isinstance(value, Image.Image):
        try:
            value = Image.fromarray(value)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValidationError(field, f"expected a PIL image or an (H, W[, 3]) uint8 array, got "
                                         f"{type(value).__name__} ({exc})") from None
    if value.mode in WIDE_GRAYS and mode != value.mode:
        value = _eight_bit(value)
    return value if value.mode == mode else value.convert(mode)


WIDE_GRAYS = ("I", "I;16", "I;16L", "I;16B", "I;16N")  # 16- and 32-bit grayscale (a 16-bit PNG: a depth map)


def _eight_bit(value):
    """A 16-bit grayscale picture scaled to 8 bits ("L"): Pillow's convert clips it (everything above 255 turns
    white). Mode "I" holds 16-bit PNGs too: scaled when any value passes 255, else taken as 8-bit levels."""
    import numpy as np
    from PIL import Image

    levels = np.asarray(value).astype(np.float64)
    if value.mode != "I" or levels.max(initial=0) > 255:
        levels = np.clip(levels, 0, 65535) / 257
    return Image.fromarray(np.clip(np.rint(levels), 0, 255).astype(np.uint8))


def _image_and_strength(p: SamplingParams, model: ModelInfo, steps: int):
    """(the start image as RGB PIL, its strength, the inpainting mask as grayscale PIL or None), or (None, None,
    None) for text to image."""
    if p.image is None:
        if p.strength is not None:
            raise ValidationError("strength", "goes with an image (image to image); give an image or leave it out")
        if p.mask_image is not None:
            raise ValidationError("mask_image", "goes with an image (inpainting repaints part of it); give the "
                                                "image too")
        if model.inpaint == "channels":
            raise ValidationError("image", f"{model.name} is an inpainting model: every request brings an image "
                                           f"and a mask_image")
        return None, None, None
    if not model.img2img:
        # e.g. Flux.2's reference images or Qwen-Image edits: not served, so say where image to image is
        raise ValidationError("image", f"{model.name} ({model.family} family) does not start from an image here; "
                                       f"allowed: no image (image to image is served for "
                                       f"{served_for('img2img')} models on the torch backend)")
    image = as_image("image", p.image, "RGB")
    mask = None
    if p.mask_image is not None:
        if not model.inpaint:
            raise ValidationError("mask_image", f"{model.name} ({model.family} family) does not inpaint here; "
                                                f"inpainting is served for {served_for('inpaint')} models on the "
                                                f"torch backend (send the image alone for image to image)")
        mask = as_image("mask_image", p.mask_image, "L")
        if mask.size != image.size:
            raise ValidationError("mask_image", f"is {mask.width}x{mask.height} (width x height); it must match "
                                                f"the image's {image.width}x{image.height}")
    elif model.inpaint == "channels":
        raise ValidationError("mask_image", f"{model.name} is an inpainting model: send a mask_image (white "
                                            f"repaints, black keeps) with the image")
    default = model.default_inpaint_strength if mask is not None else model.default_strength
    strength = default if p.strength is None else p.strength
    if not is_valid_strength(strength):
        raise ValidationError("strength", f"must be a number in (0, 1] (how much of the schedule runs on the "
                                          f"image), got {p.strength!r}")
    if first_step(steps, strength, model.img2img_start) >= steps:
        raise ValidationError("strength", f"{strength:g} x {steps} steps runs no step; raise strength or "
                                          f"num_inference_steps (at least {1 / steps:.3g} at {steps} steps)")
    return image, float(strength), mask


def _frames(value: object, model: ModelInfo) -> int | None:
    """A request's num_frames as resolved: None on an image model (which takes 1 or none), else 1 (a still image)
    when unset, or 1 + a multiple of frame_step up to max_frames."""
    if not model.video:
        if value not in (None, 1) or isinstance(value, bool):
            raise ValidationError("num_frames", f"{model.name} ({model.family}) makes images, not videos; allowed: "
                                                f"1 or unset, got {value!r}")
        return None
    if value is None:
        return 1
    if not _is_int(value) or not 1 <= value <= model.max_frames or (value - 1) % model.frame_step:
        raise ValidationError("num_frames", f"must be 1 + a multiple of {model.frame_step} from 1 to "
                                            f"{model.max_frames} (1: a still image; the video VAE packs "
                                            f"{model.frame_step} frames into one latent frame), got {value!r}")
    return value


def split_tokens(model: ModelInfo, width: int, height: int, frames: int | None) -> int:
    """The image tokens a sequence-parallel forward splits: (width / m) x (height / m) per latent frame, m the size
    multiple (the VAE's downscale times the transformer's patch)."""
    latent_frames = 1 if not frames else (frames - 1) // model.frame_step + 1
    return (width // model.size_multiple) * (height // model.size_multiple) * latent_frames


def _check_split_tokens(model: ModelInfo, width: int, height: int, frames: int | None) -> None:
    """With the tokens split over ranks (--ulysses-degree, --ring-degree), their count must divide evenly."""
    n = model.sequence_degree
    if n > 1 and split_tokens(model, width, height, frames) % n:
        m = model.size_multiple
        raise SizeError("width", width, height,
                        f": its {split_tokens(model, width, height, frames)} image tokens do not split over the "
                        f"{n} ranks of this server's sequence parallelism",
                        f"sizes whose (width / {m}) x (height / {m}) is a multiple of {n}, e.g. a width that is a "
                        f"multiple of {m * n}")


def internal_params(model: ModelInfo, **fields) -> ResolvedParams:
    """A request the engine makes for itself (warm-up, profiles, the memory probe) resolved against `model`. On an
    inpainting model, whose every request brings an image and a mask, it carries a grey image and a mask that
    repaints everything (strength 1): what any request there costs."""
    p = SamplingParams(**fields)
    if model.inpaint == "channels" and p.image is None:
        from PIL import Image

        size = (p.width or model.default_width, p.height or model.default_height)
        p.image, p.mask_image = Image.new("RGB", size, (127, 127, 127)), Image.new("L", size, 255)
        p.strength = 1.0
    return resolve_params(p, model)


def first_denoising_step(params: ResolvedParams, model: ModelInfo) -> int:
    """The step of its schedule a resolved request starts at: 0, or the steps an image's strength skips."""
    return 0 if params.image is None else first_step(params.num_inference_steps, params.strength,
                                                      model.img2img_start)


def resolve_params(params: SamplingParams, model: ModelInfo) -> ResolvedParams:
    """Validate `params` and fill unset fields with the model's defaults (and a random seed if none). Params that
    are already resolved come back as they are: a request is resolved once, where it enters."""
    if isinstance(params, ResolvedParams):
        return params
    if not isinstance(params, SamplingParams):
        raise ValidationError("params", f"expected SamplingParams, got {type(params).__name__}")
    p = params
    if not isinstance(p.prompt, str) or not p.prompt.strip():
        raise ValidationError("prompt", "must be a non-empty string")
    if len(p.prompt) > model.max_prompt_chars:
        raise ValidationError("prompt", f"is {len(p.prompt)} characters; at most {model.max_prompt_chars} allowed")
    _check_text("prompt", p.prompt)
    negative = "" if p.negative_prompt is None else p.negative_prompt
    if not isinstance(negative, str):
        raise ValidationError("negative_prompt", f"must be a string, got {type(negative).__name__}")
    if len(negative) > model.max_prompt_chars:
        raise ValidationError("negative_prompt", f"is {len(negative)} characters; at most {model.max_prompt_chars} "
                                                 "allowed")
    _check_text("negative_prompt", negative)
    if negative and not model.negative_prompt:
        raise ValidationError("negative_prompt", f"{model.name} ({model.family}) takes no negative prompt; "
                                                 "allowed: empty")

    seed = p.seed
    if seed is None:
        seed = draw_seed()
    elif not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise ValidationError("seed", f"must be an integer in [0, {MAX_SEED}], got {seed!r}")

    steps = model.default_steps if p.num_inference_steps is None else p.num_inference_steps
    if not _is_int(steps) or not 1 <= steps <= model.max_steps:
        raise ValidationError(
            "num_inference_steps", f"must be an integer in [1, {model.max_steps}], got {p.num_inference_steps!r}"
        )

    guidance = model.default_guidance_scale if p.guidance_scale is None else p.guidance_scale
    if not _is_number(guidance) or not math.isfinite(guidance) or not 0 <= guidance <= model.max_guidance_scale:
        raise ValidationError(
            "guidance_scale",
            f"must be a number in [0, {model.max_guidance_scale:g}] "
            f"({_GUIDANCE_MEANING.get(model.guidance, model.guidance)}), got {p.guidance_scale!r}",
        )

    sampler = model.default_sampler if p.sampler is None else p.sampler
    if sampler not in model.samplers:
        raise ValidationError("sampler", f"{p.sampler!r} is not supported; allowed: {', '.join(model.samplers)}")

    image, strength, mask = _image_and_strength(p, model, steps)
    if image is not None and p.height is None and p.width is None:  # the image's own size, as diffusers' img2img
        m = model.size_multiple
        height, width = image.height // m * m, image.width // m * m
    else:
        height = model.default_height if p.height is None else p.height
        width = model.default_width if p.width is None else p.width
    for name, value in (("height", height), ("width", width)):
        problem = _size_problem(value, model)
        if problem is None:
            continue
        if model.min_size == model.max_size:  # a model trained at one size (the embedded model)
            allowed = f"{model.min_size}x{model.min_size} only ({model.name} was trained at that size)"
            problem = ""  # the one allowed size says it all
        else:
            allowed = (f"width and height multiples of {model.size_multiple} from {model.min_size} to "
                       f"{model.max_size} (default {model.default_width}x{model.default_height})")
            problem = f": {name} {value!r} {problem}"
        raise SizeError(name, width, height, problem, allowed)

    frames = _frames(p.num_frames, model)
    _check_split_tokens(model, width, height, frames)

    if p.timeout_s is not None and (not _is_number(p.timeout_s) or not math.isfinite(p.timeout_s)
                                    or not p.timeout_s > 0):
        raise ValidationError("timeout_s", f"must be a positive, finite number of seconds, got {p.timeout_s!r}")

    priority = 0 if p.priority is None else p.priority
    if not _is_int(priority) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValidationError("priority", f"must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}] "
                                          f"(higher is served first), got {p.priority!r}")

    try:
        cache = parse_cache(p.cache, model)
    except CacheSpecError as exc:
        raise ValidationError("cache", str(exc)) from None
    try:
        loras = parse_loras(p.loras, model.lora_names)
    except LoraSpecError as exc:
        raise ValidationError("loras", str(exc)) from None

    try:
        controls = resolve_controls(p, model, image, lambda field, v: as_image(field, v, "RGB"))
    except ControlSpecError as exc:
        raise ValidationError(exc.field, str(exc)) from None
    try:
        ip_adapter = resolve_ip_adapter(p, model, lambda field, v: as_image(field, v, "RGB"))
    except IPAdapterSpecError as exc:
        raise ValidationError(exc.field, str(exc)) from None
    if controls and not capabilities(model.family).caches_with_controls:
        cache = None  # such a request takes every step whole (the server's default cache left out)
    resolved = {"negative_prompt": negative, "seed": seed, "num_inference_steps": steps,
                "guidance_scale": float(guidance), "sampler": sampler, "height": height, "width": width,
                "priority": priority, "cache": cache, "loras": loras, "image": image, "strength": strength,
                "mask_image": mask, "num_frames": frames, "controls": controls,
                "ip_adapter": ip_adapter}
    return ResolvedParams(**{**vars(p), **resolved})
