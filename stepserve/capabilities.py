"""What each model family serves, declared once: one frozen `Capabilities` per family, and a Protocol for the
hooks each add-on calls on an adapter that declares it (ControlHooks, ShallowControlHooks, ImagePromptHooks,
LoraHooks; the registry checks an adapter against its declaration when it looks it up).

Everything that says which family serves what reads this table: request validation (request/control_params.py,
request/validation.py, controls/spec.py), the refusal messages (`served_for`, `where_served`), the executor's
choice of hooks, the pairs of features refused at start-up (PAIRS_REFUSED, engine/loading.check_pairs), and the
docs (tests/pipelines/test_capabilities_docs.py holds docs/MODELS.md, docs/CONTROLNET.md and the README to it;
tests/test_feature_pairs.py runs every pair of features it implies). Pure data: no torch, so the request layer and
the docs' test read it without loading a model.

Adding a family's ControlNet: set `controlnets=True` (and what it serves with an image or a cache) in its
declaration here, give its adapter the control hooks (a mixin of control_inputs.py or control_mmdit.py), and let
its tiny builder (stepserve/tiny/) make a ControlNet for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class Capabilities:
    """One family's features. A feature declared here is served on the torch backend with the family's own
    networks; the exported backends and the fast path (`--compile` / `--deterministic`) run none of the add-ons
    (ControlNets, IP-Adapters) and no step caching."""

    family: str  # ModelInfo.family ("sd", "sdxl", ...)
    title: str  # how messages and the docs name it ("SD 1/2")
    img2img: bool = False  # image to image (`image`, `strength`): the family's diffusers Img2Img pipeline
    inpaint: bool = False  # inpainting (`mask_image`): an inpainting denoiser or mask blending (pipelines/inpaint.py)
    video: bool = False  # videos (`frames`, POST /v1/videos)
    lora: bool = False  # LoRA adapters (stepserve/lora)
    caches: tuple[str, ...] = ()  # the step-caching policies its networks run (stepserve/caching)
    controlnets: bool = False  # ControlNets per request (stepserve/controls)
    controls_with_image: bool = False  # ... on image to image (its diffusers ControlNet Img2Img pipeline matched)
    controls_with_mask: bool = False  # ... on inpainting (its ControlNet Inpaint pipeline matched)
    guess_mode: bool = False  # ... in guess mode (its diffusers ControlNet pipeline has `guess_mode`)
    caches_with_controls: bool = False  # step caching takes ControlNet residuals (caching/unet.py: a UNet only)
    ip_adapter: bool = False  # IP-Adapter image prompts (stepserve/ipadapter)
    no_controls_with_mask: str = ""  # why a family that inpaints takes no ControlNet there, when there is more to say
    # one request over several devices (stepserve/parallel): diffusers' context-parallel plan on its transformer
    # (--ulysses-degree, --ring-degree), its tensor-parallel plan (--tensor-parallel-size), and unconditional rows
    # of its own to run on other ranks (true classifier-free guidance: --cfg-parallel)
    sequence_parallel: bool = False
    tensor_parallel: bool = False
    true_cfg: bool = False


FAMILIES: dict[str, Capabilities] = {c.family: c for c in (
    Capabilities("sd", "SD 1/2", img2img=True, inpaint=True, lora=True, caches=("fbcache", "deepcache"),
                 controlnets=True, controls_with_image=True, controls_with_mask=True, guess_mode=True,
                 caches_with_controls=True, ip_adapter=True, true_cfg=True),
    Capabilities("sdxl", "SDXL", img2img=True, inpaint=True, lora=True, caches=("fbcache", "deepcache"),
                 controlnets=True, controls_with_image=True, controls_with_mask=True, guess_mode=True,
                 caches_with_controls=True, ip_adapter=True, true_cfg=True),
    Capabilities("sd3", "SD3", img2img=True, lora=True, controlnets=True, true_cfg=True),
    Capabilities("flux", "Flux.1", img2img=True, inpaint=True, lora=True, caches=("fbcache", "magcache"),
                 controlnets=True, controls_with_image=True,
                 no_controls_with_mask="it inpaints with Flux Fill, whose transformer takes the mask as input "
                                       "channels, and no Flux.1 ControlNet fits it",
                 sequence_parallel=True, tensor_parallel=True),
    Capabilities("qwenimage", "Qwen-Image", lora=True, caches=("fbcache",), controlnets=True,
                 sequence_parallel=True, tensor_parallel=True, true_cfg=True),
    Capabilities("flux2", "Flux.2", lora=True, sequence_parallel=True, tensor_parallel=True),
    Capabilities("wan", "Wan", video=True, sequence_parallel=True, true_cfg=True),
)}


def capabilities(family: str) -> Capabilities:
    """The declaration of `family` (ModelInfo.family); a family without one serves none of the features."""
    return FAMILIES.get(family) or Capabilities(family, family)


def served_for(feature: str) -> str:
    """The families that serve `feature` (a Capabilities field), as messages and docs say it: "SD 1/2, SDXL and
    Flux.1"."""
    titles = [c.title for c in FAMILIES.values() if getattr(c, feature)]
    return " and ".join([", ".join(titles[:-1]), titles[-1]] if len(titles) > 1 else titles) or "no family"


def where_served(feature: str) -> str:
    """served_for plus where an add-on runs at all: the words of every refusal that names the families."""
    return f"{served_for(feature)} models on the torch backend, without --compile/--deterministic"


# The docs' words for each feature (docs/MODELS.md, "Which features with which": markdown_table)
COLUMNS = {"img2img": "image to image", "inpaint": "inpainting", "video": "video", "lora": "LoRA",
           "caches": "step caching", "controlnets": "ControlNets", "controls_with_image": "ControlNets + image",
           "controls_with_mask": "ControlNets + inpainting", "guess_mode": "guess mode",
           "caches_with_controls": "ControlNets + caching", "ip_adapter": "IP-Adapter",
           "sequence_parallel": "Ulysses / ring", "true_cfg": "CFG parallel", "tensor_parallel": "tensor parallel"}


def markdown_table() -> str:
    """The table of docs/MODELS.md ("Which features with which"), made from FAMILIES: the docs' test holds the
    page to it."""
    def cell(c: Capabilities, name: str) -> str:
        value = getattr(c, name)
        return (", ".join(f"`{v}`" for v in value) or "-") if isinstance(value, tuple) else "yes" if value else "-"

    head = "| family | " + " | ".join(COLUMNS.values()) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    rows = [f"| {c.title} (`{c.family}`) | " + " | ".join(cell(c, n) for n in COLUMNS) + " |"
            for c in FAMILIES.values()]
    return "\n".join([head, rule, *rows])


# The pairs of features no family serves together, refused when a server starts (engine/loading.check_pairs), each
# with why; the names are the matrix's (tests/feature_pairs.py). Every other pair is served, or refused per request
# with a 400 naming both: PAIRS_REFUSED_PER_REQUEST, and ControlNets with what a family's declaration leaves out.
_CAST = "diffusers casts the quantized UNet's layers when an IP-Adapter goes in"
_FAST = "the fast path's fixed-shape networks run no add-ons"
PAIRS_REFUSED: dict[frozenset[str], str] = {
    frozenset({"ip_adapter", "quantize"}): _CAST,
    frozenset({"ip_adapter", "gguf"}): _CAST,
    frozenset({"ip_adapter", "offload_group"}): "the image-prompt layers it adds would stay on the CPU in float32",
    frozenset({"quantize", "gguf"}): "a GGUF file is quantized already",
    frozenset({"controlnets", "compile"}): _FAST,
    frozenset({"controlnets", "deterministic"}): _FAST,
    frozenset({"ip_adapter", "compile"}): _FAST,
    frozenset({"ip_adapter", "deterministic"}): _FAST,
    frozenset({"lora", "compile"}): "LoRA rows run at the batch's own shape, not the fast path's padded one",
    frozenset({"lora", "deterministic"}): "LoRA rows run at the batch's own shape, not the fast path's padded one",
    frozenset({"cache", "compile"}): "the fast path's fixed-shape networks run no step caching",
    frozenset({"cache", "deterministic"}): "the fast path's fixed-shape networks run no step caching",
}
_NO_CACHE = PAIRS_REFUSED[frozenset({"cache", "compile"})]  # a request's `cache` there: a 400
PAIRS_REFUSED_PER_REQUEST: dict[frozenset[str], str] = {
    frozenset({policy, fast}): _NO_CACHE for policy in ("fbcache", "deepcache", "magcache")
    for fast in ("compile", "deterministic")}


class ControlHooks(Protocol):
    """What a family that declares `controlnets` gives its ControlNets (control_inputs.py says what each does)."""

    controls_from_conditional_row: ClassVar[bool]  # the unguided row's controls are the guided row's (Qwen-Image)

    @staticmethod
    def controlnet_class() -> type: ...

    def control_problems(self, config: dict) -> list[str]: ...

    def control_image(self, image: Any, params: Any, generator: Any) -> Any: ...

    def control_forward(self, net: Any, sample: Any, timestep: Any, conditioning: dict, images: Any) -> dict: ...


class ShallowControlHooks(ControlHooks, Protocol):
    """A family that declares `caches_with_controls`: its ControlNets can run only as far as a cached step's
    shallow branch needs (caching/unet.py)."""

    def control_forward_shallow(self, net: Any, sample: Any, timestep: Any, conditioning: dict,
                                images: Any) -> dict: ...


class ImagePromptHooks(Protocol):
    """A family that declares `ip_adapter`: the UNet whose attention the adapters go into."""

    @property
    def unet(self) -> Any: ...


class LoraHooks(Protocol):
    """A family that declares `lora`: ("module:diffusers LoRA loader mixin", the denoiser's attribute name)."""

    lora_loader: ClassVar[tuple[str, str]]


HOOKS: dict[str, type] = {"controlnets": ControlHooks, "caches_with_controls": ShallowControlHooks,
                          "ip_adapter": ImagePromptHooks, "lora": LoraHooks}


def missing_hooks(adapter_class: type, declared: Capabilities) -> list[str]:
    """The features `declared` names that `adapter_class` lacks the hooks of ([] when it has them all): what a
    family's test checks, so that a declaration and its adapter cannot drift apart."""
    out = []
    for feature, protocol in HOOKS.items():
        if getattr(declared, feature):
            names = [n for n in _members(protocol) if not hasattr(adapter_class, n)]
            out += [f"{feature}: {n}" for n in names]
    return out


def _members(protocol: type) -> list[str]:
    """The names a Protocol declares (its own and its bases'), without typing's machinery."""
    names: set[str] = set()
    for base in protocol.__mro__:
        if base.__dict__.get("_is_protocol") and base is not Protocol:
            names |= {n for n in vars(base) if not n.startswith("_")} | set(vars(base).get("__annotations__", {}))
    return sorted(names)
