"""Workloads: a request mix (distributions of the request fields) and seeded traces drawn from it.

A mix file (YAML or JSON) gives each field as a scalar, a list (uniform choice) or a mapping value -> weight:

    steps: {8: 1, 20: 1, 40: 1}
    guidance_scale: 3.0
    sampler: [dpmpp_2m, euler]
    size: ["32x32"]
    prompts: ["a handwritten seven", "the digit 3"]

A trace is a list of (arrival offset, request); it is drawn in advance from a seed, so every contender gets the
identical arrivals and requests. Traces are saved and loaded as CSV or JSONL (one request per line; trace_files.py).

Videos: `frames: [5, 9]` gives each request a frame count (a video model's; drawn from the request's own seed, so
the trace is otherwise the one without it). Such requests run in process only: the images endpoint makes images.

Edits: `edit: {none: 1, image: 1}` with `strength: [0.3, 0.5, 0.8]` makes half the requests image-to-image edits of
a pooled image (`inpaint`: with a mask; bench/edits.py); such a mix needs `size`. ControlNets: `control: {none: 7,
edge: 3}` gives 30% of the requests the ControlNet `edge` with a pooled image as its map (needs `size` too); IP-Adapters:
`ip_adapter: {none: 3, face: 1}` gives a quarter of them an image prompt of adapter `face`, its picture a pooled image.

Several models: `model: {sd15: 1, flux: 1}` makes each request name one served model (the request body's `model`;
on the simulated clock, that model's engine), drawn from the request's own seed, so the trace is otherwise the
one without it. A trace row's `model` column does the same per row.

A request may carry a deadline (timeout_s, seconds from its arrival at the engine); a benchmark with deadlines
puts the same one on every request (Trace.with_timeout, user_requests(timeout_s=...)).

A trace row may carry its own SLO (slo_ms, milliseconds from its send; the layout of public text-to-image serving
traces: per-request width, height, num_inference_steps or steps, seed, optional slo_ms). That SLO is the request's
deadline too: a row with slo_ms and no timeout_s gets timeout_s = slo_ms / 1000, and a run-wide deadline
(--timeout-s, --timeout-slo: Trace.with_timeout) applies only to the requests without their own slo_ms; a row
that gives both keeps both as given. The metrics judge SLO attainment and goodput of such a request against its
own SLO, and of the others against the run's.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..util.digits import DIGIT_PROMPTS
from .choice import Choice
from ..request.types import SamplingParams
from ..request.validation import DRAWN_SEED_LIMIT, parse_size


@dataclass
class RequestSpec:
    """One request of a workload. None means: the model's default."""

    prompt: str
    seed: int
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    sampler: str | None = None
    height: int | None = None
    width: int | None = None
    negative_prompt: str = ""
    timeout_s: float | None = None  # deadline, seconds after the request reaches the engine; None: no deadline
    slo_ms: float | None = None  # this request's own latency SLO (a trace's), judged by the metrics; None: the run's
    cache: Any = None  # step caching: "off", a policy name or {"policy": ..., knobs}; None: the server's default
    loras: Any = None  # LoRA adapters: [{"name": ..., "scale": ...}]; None: none
    edit: str | None = None  # "image" (image to image) or "inpaint" (with a mask); None: a generation (bench/edits)
    strength: float | None = None  # an edit's strength; None: the model's default
    image: int | None = None  # an edit's image or a control's map: its index in the bench's image pool (bench/edits.py)
    control: str | None = None  # a ControlNet by name, its map the pool's image `image`; None: no control
    ip_adapter: str | None = None  # an IP-Adapter by name, its picture the pool's image `ip_image`; None: none
    ip_image: int | None = None  # the image prompt's picture: its index in the bench's image pool
    num_frames: int | None = None  # a video model's frames; None: the model's default (an image)
    model: str | None = None  # the served model it names (the body's "model"); None: the server's default

    def to_params(self) -> SamplingParams:
        params = SamplingParams(prompt=self.prompt, negative_prompt=self.negative_prompt, seed=self.seed,
                                num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
                                sampler=self.sampler, height=self.height, width=self.width, timeout_s=self.timeout_s,
                                cache=self.cache, loras=self.loras, num_frames=self.num_frames)
        if self.edit is not None:
            from .edits import edit_images

            params.image, params.mask_image = edit_images(self)
            params.strength = self.strength
        if self.control is not None:
            from .edits import control_fields

            params.controls = control_fields(self)
        if self.ip_adapter is not None:
            from .edits import image_prompt_field

            params.ip_adapter = image_prompt_field(self)
        return params

    def to_http(self) -> dict[str, Any]:
        """The body of POST /v1/images/generations (OpenAI fields plus stepserve's own)."""
        if self.num_frames is not None:
            raise ValueError(f"a video request ({self.num_frames} frames) runs in process only: the images endpoint "
                             "makes images")
        body: dict[str, Any] = {"prompt": self.prompt, "n": 1, "response_format": "b64_json", "seed": self.seed}
        if self.height is not None and self.width is not None:
            body["size"] = f"{self.width}x{self.height}"
        for name in ("num_inference_steps", "guidance_scale", "sampler", "timeout_s", "cache", "loras"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.negative_prompt:
            body["negative_prompt"] = self.negative_prompt
        if self.model is not None:
            body["model"] = self.model
        if self.control is not None:
            from .edits import control_fields

            body["controls"] = control_fields(self, encoded=True)
        if self.ip_adapter is not None:
            from .edits import image_prompt_field

            body["ip_adapter"] = image_prompt_field(self, encoded=True)
        return body


MIX_FIELDS = ("steps", "guidance_scale", "sampler", "size", "prompts", "negative_prompt", "cache", "lora", "edit",
              "strength", "frames", "control", "ip_adapter", "model")


@dataclass
class Mix:
    steps: Choice = field(default_factory=lambda: Choice([20], [1.0]))
    guidance_scale: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    sampler: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    size: Choice = field(default_factory=lambda: Choice([None], [1.0]))  # "WxH" or None
    prompts: Choice = field(default_factory=lambda: Choice(list(DIGIT_PROMPTS), [1.0] * len(DIGIT_PROMPTS)))
    negative_prompt: Choice = field(default_factory=lambda: Choice([""], [1.0]))
    # step caching per request ("off", a policy name, or in a list {"policy": ..., knobs}); None: the server's
    # default. Drawn from the request's own seed, so a mix with and without it gives the same requests otherwise.
    cache: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    # one LoRA adapter per request, by name ("none": no adapter), drawn from the request's own seed like cache
    lora: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    # edits: "none" (a generation), "image" (image to image) or "inpaint", each from a pooled image (bench/edits.py),
    # at a strength drawn from `strength` (None: the model's default); drawn from the request's own seed
    edit: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    strength: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    # a video model's frames per request, drawn from the request's own seed; None: the model's default
    frames: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    # one ControlNet per request, by name ("none": no control), its map a pooled image; from the request's own seed
    control: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    # one IP-Adapter per request, by name ("none": no image prompt), its picture a pooled image; likewise
    ip_adapter: Choice = field(default_factory=lambda: Choice([None], [1.0]))
    # the served model each request names (the body's "model"; the simulator routes it to that model's engine),
    # drawn from the request's own seed; None: the server's default
    model: Choice = field(default_factory=lambda: Choice([None], [1.0]))

    @classmethod
    def from_steps(cls, steps: list[int]) -> "Mix":
        return cls(steps=Choice([int(s) for s in steps], [1.0] * len(steps)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Mix":
        unknown = set(data) - set(MIX_FIELDS)
        if unknown:
            raise ValueError(f"mix: unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(MIX_FIELDS)}")
        mix = cls(**{k: Choice.of(v, k) for k, v in data.items()})
        mix.steps = Choice([int(v) for v in mix.steps.values], mix.steps.weights)
        for v in mix.size.values:
            if v is not None:
                parse_size(v)
        if any(not (v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1))
               for v in mix.frames.values):
            raise ValueError(f"mix field 'frames': {mix.frames.values!r}; allowed: whole numbers >= 1")
        from .edits import EDIT_KINDS

        edits = {v for v in mix.edit.values if v not in (None, "none")}
        if edits - set(EDIT_KINDS):
            raise ValueError(f"mix field 'edit': {sorted(map(str, edits - set(EDIT_KINDS)))[0]!r}; allowed: none, "
                             f"{', '.join(EDIT_KINDS)}")
        if (edits or mix.control.values != [None] or mix.ip_adapter.values != [None]) and None in mix.size.values:
            raise ValueError("mix: an edit, control or ip_adapter mix needs `size` (the pool's images are drawn at "
                             "each request's size)")
        return mix

    @classmethod
    def load(cls, path: str | Path) -> "Mix":
        return cls.from_dict(_read_mapping(Path(path)))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: {"values": getattr(self, f.name).values, "weights": getattr(self, f.name).weights}
                for f in fields(self)}

    def draw(self, rng: random.Random) -> RequestSpec:
        size = self.size.draw(rng)
        width, height = (None, None) if size is None else parse_size(size)
        guidance = self.guidance_scale.draw(rng)
        spec = RequestSpec(prompt=str(self.prompts.draw(rng)), seed=rng.randrange(DRAWN_SEED_LIMIT),
                           num_inference_steps=int(self.steps.draw(rng)),
                           guidance_scale=None if guidance is None else float(guidance),
                           sampler=self.sampler.draw(rng), height=height, width=width,
                           negative_prompt=str(self.negative_prompt.draw(rng) or ""))
        if self.cache.values != [None]:
            spec.cache = self.cache.draw(random.Random(f"cache-{spec.seed}"))
        if self.lora.values != [None]:
            name = self.lora.draw(random.Random(f"lora-{spec.seed}"))
            spec.loras = None if name in (None, "none", "off") else [{"name": str(name), "scale": 1.0}]
        if self.edit.values != [None]:
            from .edits import POOL_SIZE

            edits = random.Random(f"edit-{spec.seed}")
            kind = self.edit.draw(edits)
            if kind not in (None, "none"):
                strength = self.strength.draw(edits)
                spec.edit, spec.image = str(kind), edits.randrange(POOL_SIZE)
                spec.strength = None if strength is None else float(strength)
        for name, picture in (("control", "image"), ("ip_adapter", "ip_image")):  # a pooled map or picture
            if getattr(self, name).values != [None]:
                from .edits import POOL_SIZE

                drawn = random.Random(f"{name.replace('_', '-')}-{spec.seed}")
                value = getattr(self, name).draw(drawn)
                if value not in (None, "none", "off"):
                    setattr(spec, name, str(value))
                    setattr(spec, picture, drawn.randrange(POOL_SIZE))
        if self.frames.values != [None]:
            frames = self.frames.draw(random.Random(f"frames-{spec.seed}"))
            spec.num_frames = None if frames is None else int(frames)
        if self.model.values != [None]:
            name = self.model.draw(random.Random(f"model-{spec.seed}"))
            spec.model = None if name is None else str(name)
        return spec

    @property
    def videos(self) -> bool:
        """Whether the mix gives requests a frame count (in process only)."""
        return self.frames.values != [None]

    def heaviest(self, steps: int) -> RequestSpec:
        """A request with these steps and the costliest other settings of the mix (largest size, with guidance)."""
        sizes = [parse_size(s) for s in self.size.values if s is not None]
        width, height = max(sizes, key=lambda s: s.width * s.height) if sizes else (None, None)
        scales = [g for g in self.guidance_scale.values if g is not None]
        guidance = max(scales) if scales else None
        frames = [f for f in self.frames.values if f is not None]
        return RequestSpec(prompt=str(self.prompts.values[0]), seed=0, num_inference_steps=steps,
                           guidance_scale=guidance, sampler=self.sampler.values[0], height=height, width=width,
                           num_frames=max(frames) if frames else None)


def _read_mapping(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of mix fields; allowed: {', '.join(MIX_FIELDS)}")
    return data


# --- traces ----------------------------------------------------------------------------------------------------
@dataclass
class TraceItem:
    offset_s: float  # scheduled send time, seconds after the start of the run
    spec: RequestSpec


@dataclass
class Trace:
    items: list[TraceItem]
    description: str = ""

    @property
    def duration_s(self) -> float:
        return self.items[-1].offset_s if self.items else 0.0

    def with_timeout(self, timeout_s: float | None) -> "Trace":
        """The same arrivals and requests, every request with this deadline (None: leave them as they are), except
        those with their own slo_ms: their deadline stays the one they carry (a per-request SLO wins)."""
        if timeout_s is None:
            return self
        items = [it if it.spec.slo_ms is not None else TraceItem(it.offset_s, replace(it.spec, timeout_s=timeout_s))
                 for it in self.items]
        own = self.own_slos
        who = f"every request without its own slo_ms ({own} have one)" if own else "every request"
        return Trace(items, f"{self.description}, {who} with timeout_s {timeout_s:.3g} s")

    @property
    def own_slos(self) -> int:
        """How many requests carry their own SLO (slo_ms)."""
        return sum(1 for it in self.items if it.spec.slo_ms is not None)


def poisson_trace(mix: Mix, rate: float, duration_s: float, seed: int) -> Trace:
    """Poisson arrivals at `rate` req/s over [0, duration_s), requests drawn from the mix; fully seeded."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    arrivals = random.Random(f"arrivals-{seed}")
    requests = random.Random(f"requests-{seed}")
    items: list[TraceItem] = []
    t = arrivals.expovariate(rate)
    while t < duration_s:
        items.append(TraceItem(t, mix.draw(requests)))
        t += arrivals.expovariate(rate)
    return Trace(items, f"poisson {rate:.3g} req/s for {duration_s:g} s, seed {seed}")


def user_requests(mix: Mix, seed: int, user: int, timeout_s: float | None = None):
    """The endless, seeded request sequence of one closed-loop user (identical for every contender); with
    `timeout_s`, every request carries that deadline."""
    rng = random.Random(f"user-{seed}-{user}")
    while True:
        spec = mix.draw(rng)
        if timeout_s is not None:
            spec.timeout_s = timeout_s
        yield spec
