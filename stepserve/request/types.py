"""Plain data that crosses stepserve's layers.

Nothing here imports torch: the scheduling layer works on these types alone. Tensors that ride on a request
(latents, prompt embeddings, sampler state) are typed as ``Any`` and only touched by the executor.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from ..caching.spec import CacheSpec
from .buckets import Bucket


# Each sampler and the diffusers scheduler class it reproduces (and reads its tables from).
SCHEDULER_CLASSES = {
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
    "flow_euler": "FlowMatchEulerDiscreteScheduler",
}
SAMPLER_NAMES = tuple(SCHEDULER_CLASSES)


@dataclass
class SamplingParams:
    """What a caller asks for. Unset fields (None) take the model's defaults when the request is admitted."""

    prompt: str
    negative_prompt: str = ""
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    sampler: str | None = None
    height: int | None = None
    width: int | None = None
    timeout_s: float | None = None  # deadline relative to arrival; None = no deadline
    priority: int = 0  # higher is served first by priority-aware policies (slo); range in validation.py
    # step caching: a CacheSpec, a policy name, {"policy": ..., knobs}, or "off"; None: the server's default
    cache: Any = None
    # LoRA adapters: [{"name": ..., "scale": ...}] (resolved: a tuple of (name, scale)); None: none
    loras: Any = None
    # image to image: the image to start from (a PIL image; resolved: RGB), and how much of the schedule to run on
    # it (strength in (0, 1]; default: the family's img2img pipeline's, ModelInfo.default_strength); None: text to image
    image: Any = None
    strength: float | None = None
    # inpainting: a mask of the image's size (PIL or array; white repaints, black keeps; resolved: a grayscale PIL
    # image), only with `image`; the default strength is then the family's inpaint pipeline's
    mask_image: Any = None
    # video: how many frames (a video model only; 1, the default there, is a still image). None on an image model
    num_frames: int | None = None
    # ControlNets: [{"name", "image", "scale", "start", "end"}] (resolved: a tuple of stepserve.controls.spec.Control;
    # scale 1, start 0 and end 1 unless given); None: none
    controls: Any = None
    # IP-Adapter: {"name", "image", "scale"}, or a list of those for several adapters (resolved: a tuple of
    # stepserve.ipadapter.spec.ImagePrompt; scale 1 unless given); None: no image prompt
    ip_adapter: Any = None


@dataclass
class ResolvedParams(SamplingParams):
    """SamplingParams checked against a model with every field set: model defaults filled in, seed drawn. Only
    stepserve.request.validation.resolve_params makes one, at the edge that received the request (HTTP, the Python API,
    Triton); everything after it (the engine core, the executor) takes it as it is, so a request is resolved once."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # validated and queued, not yet admitted into a batch
    RUNNING = "running"  # admitted: prompt encoded, latents live, taking denoising steps
    COMPLETED = "completed"
    FAILED = "failed"  # with a reason: executor error or deadline passed
    CANCELLED = "cancelled"  # aborted by the caller
    REJECTED = "rejected"  # refused at submission (queue full, shutting down)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class FinishReason(enum.Enum):
    COMPLETED = "completed"
    ERROR = "error"  # the executor raised while this request was in the step
    TIMEOUT = "timeout"  # deadline passed
    ABORTED = "aborted"  # the caller went away or called abort()
    QUEUE_FULL = "queue_full"  # refused at admission: the queue was at its bound
    DEADLINE_INFEASIBLE = "deadline_infeasible"  # refused at admission: predicted to miss its deadline


@dataclass
class RequestTiming:
    """Times are on the engine's clock (seconds); durations are derived properties."""

    arrival: float
    admitted: float | None = None
    first_step_done: float | None = None
    denoise_done: float | None = None
    finished: float | None = None
    batch_sizes: list[int] = field(default_factory=list)  # size of every forward this request took part in
    cached_steps: int = 0  # denoising steps that reused cached work (step caching) instead of the whole denoiser

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.arrival

    @property
    def denoise_s(self) -> float | None:
        if self.admitted is None or self.denoise_done is None:
            return None
        return self.denoise_done - self.admitted

    @property
    def decode_s(self) -> float | None:
        if self.denoise_done is None or self.finished is None:
            return None
        return self.finished - self.denoise_done

    @property
    def total_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


_request_ids = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_request_ids)}"


@dataclass(eq=False)
class Request:
    """One image being generated. All per-request state lives here, including the progress counter `step`."""

    request_id: str
    params: SamplingParams  # resolved: every field set (model defaults filled in, seed drawn)
    arrival_time: float
    bucket: Bucket  # the shape bucket (bucket_of): only requests of one shape bucket share a forward
    num_inference_steps: int
    deadline: float | None = None
    priority: int = 0  # from SamplingParams.priority: higher is served first by priority-aware policies
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    cause: Any = None  # the exception it failed on, where typed ones tell the client more (server/errors.py)
    step: int = 0  # denoising steps done so far (the one progress counter)
    preview_steps: frozenset[int] = frozenset()  # after these steps, keep an x0 estimate for a preview image
    timing: RequestTiming = field(default=None)  # type: ignore[assignment]
    # Executor-owned state (tensors), set on admission and dropped when the request finishes:
    latents: Any = None
    conditioning: Any = None  # the family adapter's Conditioning (pipelines/family.py): cond and optional uncond row
    sampler_state: Any = None
    preview_latents: Any = None  # the denoised estimate (x0) after a step listed in preview_steps
    image: Any = None  # PIL.Image once decoded (a video: its first frame)
    frames: Any = None  # a video model's request: its frames once decoded (a list of PIL images; one for an image)
    step_cache: Any = None  # the step-caching state of this request (stepserve/caching.RowState); freed at the end
    inpaint: Any = None  # an inpainting request's mask and known region (pipelines/inpaint.Inpaint)
    controls: Any = None  # its control images prepared for the ControlNets (stepserve/controls/rows.Prepared)
    image_prompt: Any = None  # its IP-Adapter image embeddings: a tuple of stepserve/ipadapter/rows.Embedded

    def __post_init__(self) -> None:
        if self.timing is None:
            self.timing = RequestTiming(arrival=self.arrival_time)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def release_tensors(self) -> None:
        self.latents = None
        self.conditioning = None
        self.sampler_state = None
        self.preview_latents = None
        self.step_cache = None
        self.inpaint = None
        self.controls = None
        self.image_prompt = None


@dataclass
class GenerationResult:
    """A request's outcome as callers see it (offline Engine, AsyncEngine)."""

    request_id: str
    status: RequestStatus
    image: Any  # PIL.Image when completed, else None (a video: its first frame)
    params: SamplingParams  # as resolved: defaults filled in, seed drawn
    timing: RequestTiming
    finish_reason: FinishReason | None
    error: str | None = None
    frames: Any = None  # a video model's request, completed: every frame (a list of PIL images)
    cause: Any = None  # the exception it failed on (Request.cause)

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.COMPLETED

    @classmethod
    def from_request(cls, r: "Request") -> "GenerationResult":
        return cls(r.request_id, r.status, r.image, r.params, r.timing, r.finish_reason, r.error, r.frames, r.cause)


@dataclass
class StepPlan:
    """What the policy decided for one engine step."""

    admit: list[Request] = field(default_factory=list)  # waiting requests that join the running set now
    run: list[Request] = field(default_factory=list)  # running requests (incl. admitted) that take one step now
    wake_at: float | None = None  # with nothing to run: the earliest time at which the plan may change
    # requests (waiting or running) that can no longer meet their deadline: the engine ends them at once as
    # FAILED / TIMEOUT, saying how far they got; they must not appear in admit or run
    give_up: list[Request] = field(default_factory=list)


@dataclass
class StepReport:
    """What one engine step did, for callers (server, simulator, benchmarks)."""

    now: float  # the time the step was given
    duration_s: float  # executor time spent (encode + denoise + decode); the engine's clock moves by this much
    batch_size: int  # requests in the denoising forward pass (0 = idle step)
    finished: list[Request] = field(default_factory=list)  # requests that reached a final state in this step
    progressed: list[Request] = field(default_factory=list)  # requests that took a denoising step
    admitted: list[Request] = field(default_factory=list)  # requests that joined the running set at this step
    wake_at: float | None = None  # forwarded from the plan when the engine is idle but waiting
    encode_s: float = 0.0
    denoise_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What a pipeline serves and its defaults; used to validate and resolve SamplingParams."""

    name: str
    default_sampler: str
    default_steps: int
    default_guidance_scale: float
    default_height: int
    default_width: int
    size_multiple: int  # height and width must be multiples of this
    min_size: int
    max_size: int
    max_steps: int = 200
    max_guidance_scale: float = 50.0
    max_prompt_chars: int = 2000
    samplers: tuple[str, ...] = SAMPLER_NAMES
    # What the model family lets a request set (docs/MODELS.md): its name in messages, whether a negative prompt
    # is taken, and how guidance_scale acts: "cfg" (classifier-free guidance, an extra row when > 1) or
    # "embedded" (a value fed to the denoiser, e.g. Flux.1 dev's guidance embedding).
    family: str = "sd"
    negative_prompt: bool = True
    guidance: str = "cfg"
    cache_policies: tuple[str, ...] = ()  # step-caching policies this pipeline runs (stepserve/caching)
    default_cache: CacheSpec | None = None  # applied to requests that do not say (the server's --cache)
    lora_names: frozenset[str] = frozenset()  # LoRA adapters loaded now (stepserve/lora)
    controls: bool = False  # requests may name ControlNets (stepserve/controls): the family and backend run them
    control_names: frozenset[str] = frozenset()  # the ControlNets served (--controlnet-dir)
    control_guess_only: frozenset[str] = frozenset()  # those that run in guess mode only (global_pool_conditions)
    ip_adapters: bool = False  # requests may give an image prompt (stepserve/ipadapter): the family runs them
    ip_adapter_names: frozenset[str] = frozenset()  # the IP-Adapters served (--ip-adapter-dir)
    img2img: bool = False  # requests may start from an image (SamplingParams.image)
    default_strength: float = 0.8  # its strength when a request gives none (the family's img2img pipeline's)
    img2img_start: str = "floor_steps"  # how its pipeline rounds the start step (img2img_spec.first_step)
    # inpainting (SamplingParams.mask_image): "" none; "blend" (the known region blended back after every step, an
    # ordinary denoiser); "channels" (an inpainting denoiser: mask and masked image are extra input channels, and
    # every request must bring an image and a mask)
    inpaint: str = ""
    default_inpaint_strength: float = 1.0  # its strength when an inpainting request gives none
    # video (a latent time axis): the most frames a request may ask for (1: an image model), num_frames - 1 must be
    # a multiple of frame_step (a video VAE packs that many frames into one latent frame), and what the videos
    # endpoint uses when a request does not say (frames, frames per second)
    max_frames: int = 1
    # ranks the image tokens of one forward are split over (stepserve/parallel: --ulysses-degree x --ring-degree);
    # a request's token count must divide by it
    sequence_degree: int = 1
    frame_step: int = 1
    default_frames: int = 1
    default_fps: int = 16

    @property
    def video(self) -> bool:
        return self.max_frames > 1
