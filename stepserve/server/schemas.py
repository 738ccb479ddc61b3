"""The request body of POST /v1/images/generations, how it is parsed, and how it becomes engine requests.

Parsing is strict and total: any body (bad JSON, wrong types, unknown fields, out-of-range values) either becomes
an ImageGenerationRequest or an APIError 400 naming the field and what is allowed. Unknown fields are refused
(a typo such as "seeds" would otherwise be silently ignored); OpenAI fields that do not change a stepserve image
(quality, style, moderation, ...) are accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..request.types import SamplingParams
from ..request.validation import MAX_SEED, ValidationError, draw_seed, parse_size
from .bodies import from_fields, parse_object
from .errors import APIError, invalid

MAX_PARTIAL_IMAGES = 3


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP request may ask for (the model's own limits on steps, size and prompt come on top)."""

    max_n: int = 8
    max_body_bytes: int = 64 * 1024  # a JSON body; each text field of a multipart form too
    max_upload_bytes: int = 33 * 2**20  # a whole multipart form (an edit: an image and a mask of 16 MiB, the fields)
    default_timeout_s: float | None = None  # applied when a request has no timeout_s of its own
    max_video_jobs: int = 64  # video jobs queued or running in the whole service at once; beyond it, POST gets 429
    max_image_jobs: int = 256  # async image jobs (Prefer: respond-async) queued or running at once; beyond, 429
    max_running_jobs: int | None = None  # jobs one process runs at once; None: the engine's max_batch_size
    served_model_names: tuple[str, ...] = ()  # aliases a request's "model" may name besides the model's own name
    other_models: tuple[str, ...] = ()  # a server of several models: the others' names (listed in a 404)


class ImageGenerationRequest(BaseModel):
    # allow_inf_nan=False: a number too large for a float (1e309) parses to inf; every field refuses it
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # OpenAI fields
    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: str | None = None
    stream: bool | None = None
    partial_images: int | None = None
    user: str | None = None
    output_format: str | None = None
    background: str | None = None
    # OpenAI fields accepted and ignored: they do not change what stepserve generates
    quality: str | None = None
    style: str | None = None
    moderation: str | None = None
    output_compression: int | None = None
    safety_identifier: str | None = None
    # stepserve fields
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    sampler: str | None = None
    negative_prompt: str | None = None
    timeout_s: float | None = None
    priority: int | None = None  # higher first under the slo strategy; default 0
    # step caching: "off", a policy name, or {"policy": ..., knobs}; default: the server's --cache
    cache: str | dict[str, Any] | None = None
    # LoRA adapters: [{"name": ..., "scale": ...}] (loaded with POST /v1/loras or --lora-dir)
    loras: list[dict[str, Any]] | None = None
    # ControlNets: [{"name", "image" (base64 PNG/JPEG/WebP), "scale", "start", "end", "preprocess"}]
    # (--controlnet-dir)
    controls: list[dict[str, Any]] | None = None
    # IP-Adapter: {"name", "image" (base64 PNG/JPEG/WebP), "scale"}, or a list of those (--ip-adapter-dir)
    ip_adapter: dict[str, Any] | list[Any] | None = None
    # an async request's job (Prefer: respond-async) notifies this URL once when it completes or fails
    webhook: str | None = None


FIELDS = tuple(ImageGenerationRequest.model_fields)


def parse_body(raw: bytes, limits: ServerLimits) -> ImageGenerationRequest:
    req = parse_object(raw, ImageGenerationRequest, '{"prompt": "a red fox", "size": "512x512"}')
    _check(req, limits)
    return req


def body_from_fields(fields: dict, limits: ServerLimits) -> ImageGenerationRequest:
    """The same checks on a dict of fields (an edit's form)."""
    req = from_fields(fields, ImageGenerationRequest)
    _check(req, limits)
    return req


def _check(req: ImageGenerationRequest, limits: ServerLimits) -> None:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= limits.max_n:
        raise invalid(f"n: must be an integer from 1 to {limits.max_n}, got {n}", "n")
    if req.response_format not in (None, "b64_json"):
        raise invalid(f"response_format: only 'b64_json' is supported (images are returned inline), got "
                      f"{req.response_format!r}", "response_format")
    if req.output_format not in (None, "png"):
        raise invalid(f"output_format: only 'png' is supported, got {req.output_format!r}", "output_format")
    if req.background not in (None, "auto", "opaque"):
        raise invalid(f"background: allowed 'auto' or 'opaque', got {req.background!r}", "background")
    if req.partial_images is not None and not 0 <= req.partial_images <= MAX_PARTIAL_IMAGES:
        raise invalid(f"partial_images: must be an integer from 0 to {MAX_PARTIAL_IMAGES}, got {req.partial_images}",
                      "partial_images")
    if req.partial_images and not req.stream:
        raise invalid("partial_images: needs \"stream\": true (partial images only exist as stream events)",
                      "partial_images")
    if req.output_compression is not None and not 0 <= req.output_compression <= 100:
        raise invalid(f"output_compression: must be from 0 to 100, got {req.output_compression}", "output_compression")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED - (n - 1):
        raise invalid(f"seed: must be an integer in [0, {MAX_SEED - (n - 1)}] (image i uses seed + i), got {req.seed}",
                      "seed")
    request_size(req.size)


def served_names(model: str, limits: ServerLimits) -> tuple[str, ...]:
    """The names a request's "model" may give, as GET /v1/models lists them: the model's own, then the aliases of
    --served-model-name (an operator whose clients send a fixed name, such as "dall-e-3")."""
    return (model, *(a for a in dict.fromkeys(limits.served_model_names) if a != model))


def check_model(name: str | None, model: str, limits: ServerLimits) -> None:
    """A request that names a model (its "model", GET /v1/models/{id}) names one served here, or it is answered
    404 model_not_found as OpenAI and vLLM answer: another model never stands in for it silently. A request without
    "model" gets the one served."""
    if name is None:
        return
    names = served_names(model, limits)
    if name not in names:
        raise model_not_found(name, (*names, *limits.other_models))


def model_not_found(name: str, served) -> APIError:
    """The 404 of a model not served here, listing the names that are (one model's, or every model's)."""
    return APIError(404, f"model: {name[:100]!r} is not served here; served: {', '.join(served)} (GET /v1/models)",
                    code="model_not_found", param="model")


def serves(info) -> dict:
    """What a loaded model serves, as GET /v1/models shows it: images, edits, videos, and its add-ons by name."""
    return {"images": True, "edits": bool(info.img2img or info.inpaint), "videos": bool(info.video),
            "loras": sorted(info.lora_names), "controlnets": sorted(info.control_names),
            "ip_adapters": sorted(info.ip_adapter_names)}


def request_size(size: str | None) -> tuple[int | None, int | None]:
    """The body's "size" -> (width, height); None or 'auto' -> the model's default (None, None)."""
    if size is None or size == "auto":
        return None, None
    try:
        return parse_size(size)
    except ValidationError:
        message = f"size: expected 'WIDTHxHEIGHT' such as '512x512' or 'auto', got {size[:40]!r}"
        raise invalid(message, "size") from None


def engine_params(req: ImageGenerationRequest, limits: ServerLimits) -> list[SamplingParams]:
    """One SamplingParams per image: seeds seed, seed+1, ...; with no seed one is drawn (and reported back)."""
    n = 1 if req.n is None else req.n
    seed = draw_seed() if req.seed is None else req.seed
    width, height = request_size(req.size)
    timeout = req.timeout_s if req.timeout_s is not None else limits.default_timeout_s
    return [
        SamplingParams(prompt=req.prompt, negative_prompt=req.negative_prompt or "", seed=seed + i,
                       num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
                       sampler=req.sampler, height=height, width=width, timeout_s=timeout, priority=req.priority, cache=req.cache,
                       loras=req.loras)
        for i in range(n)
    ]
