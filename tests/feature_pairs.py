"""The combination matrix's parts (tests/test_feature_pairs.py): every feature a server or a request can ask for,
which tiny family hosts a pair (the first that serves both, by stepserve/capabilities.py), what the pair should
get (served, refused at start-up, refused at admission), and how an engine and a request with a pair are made.

Start-up features are flags of `stepserve serve` (an EngineConfig); request features are fields of a request (and
the add-on folder the engine then serves). `--offload` moves nothing on the CPU: the engine gets an executor
loaded with the hooks in place (as tests/pipelines/test_offload.py does), the rest goes through build_engine."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace
from pathlib import Path

from edit_images import mask_image, start_image

from stepserve import SamplingParams
from stepserve import capabilities as caps

START = ("quantize", "offload_model", "offload_group", "single_file", "gguf", "deterministic", "compile")
REQUEST = ("lora", "controlnets", "ip_adapter", "fbcache", "deepcache", "magcache", "img2img", "inpaint", "video")
FEATURES = START + REQUEST
TINY = ("sd", "flux", "wan")  # the hosts, cheapest first; Flux.1 inpaints only with a Fill folder (not this one)
NOT_ON_TINY = {("flux", "inpaint")}
# one weights file replaces the denoiser: a single .safetensors or a .gguf, never both
APART = {frozenset({"single_file", "gguf"})}
SLOW = {"compile"}  # torch.compile traces every bucket at start-up: with the slow tests only

# The words that name a feature in a refusal (a 400's message or a start-up line), lower case
WORDS = {"quantize": ("--quantize",), "offload_model": ("--offload",), "offload_group": ("--offload",),
         "single_file": ("--unet", "--transformer"), "gguf": ("gguf",), "deterministic": ("--deterministic",),
         "compile": ("--compile",), "lora": ("lora",), "controlnets": ("controlnet", "controls"),
         "ip_adapter": ("ip-adapter", "ip_adapter", "image prompt"), "fbcache": ("cach",), "deepcache": ("cach",),
         "magcache": ("cach",), "cache": ("--cache",), "img2img": ("image to image", "with an image"), "inpaint": ("inpaint", "mask"),
         "video": ("video", "frames")}


def serves(family: str, feature: str) -> bool:
    """Whether the tiny `family` serves `feature` alone (start-up features: every family on the torch backend)."""
    if feature in START or (family, feature) in NOT_ON_TINY:
        return feature in START and (family, feature) not in NOT_ON_TINY
    declared = caps.capabilities(family)
    if feature in ("fbcache", "deepcache", "magcache"):
        return feature in declared.caches
    return getattr(declared, {"controlnets": "controlnets"}.get(feature, feature))


def host(pair: tuple[str, str]) -> str | None:
    """The first tiny family that serves both features of `pair` alone; None: no family serves both."""
    return next((f for f in TINY if all(serves(f, x) for x in pair)), None)


def pairs() -> list[tuple[str, str]]:
    """Every pair of features that some family serves each of, in FEATURES order."""
    return [p for p in itertools.combinations(FEATURES, 2) if frozenset(p) not in APART and host(p) is not None]


def sampled(count: int) -> list[tuple[str, str]]:
    """A fixed handful of the pairs hosted by tiny SD without a slow feature (the default run's share): the first
    `count` by a hash of their names, so the sample is the same on every run and spread over the matrix."""
    cheap = [p for p in pairs() if host(p) == "sd" and not SLOW & set(p)]
    return sorted(cheap, key=lambda p: hashlib.sha1(" ".join(p).encode()).hexdigest())[:count]


def expected(pair: tuple[str, str]) -> str:
    """"served", "start" (refused at start-up) or "admission" (a 400), by the declarations."""
    if frozenset(pair) in caps.PAIRS_REFUSED:
        return "start"
    if frozenset(pair) in caps.PAIRS_REFUSED_PER_REQUEST:
        return "admission"
    declared = caps.capabilities(host(pair))
    if "controlnets" in pair:
        other = next(x for x in pair if x != "controlnets")
        if (other in ("fbcache", "deepcache", "magcache") and not declared.caches_with_controls
                or other == "img2img" and not declared.controls_with_image
                or other == "inpaint" and not declared.controls_with_mask):
            return "admission"
    return "served"


def names_both(message: str, pair: tuple[str, str]) -> bool:
    text = message.lower()
    return all(any(w in text for w in WORDS[x]) for x in pair)


class Tiny:
    """The tiny folders and add-ons the matrix needs, built once per session on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict = {}

    def _once(self, key, build):
        if key not in self._made:
            self._made[key] = build()
        return self._made[key]

    def folder(self, family: str) -> Path:
        def build():
            if family == "sd":
                from stepserve.tiny.sd import build_tiny_sd

                return build_tiny_sd(self.root / "sd")
            if family == "flux":
                from stepserve.tiny.flux import build_tiny_flux

                return build_tiny_flux(self.root / "flux", variant="dev")
            from stepserve.tiny.wan import build_tiny_wan

            return build_tiny_wan(self.root / "wan")
        return self._once(family, build)

    def part(self, family: str) -> str:
        return "unet" if family == "sd" else "transformer"

    def weights_file(self, family: str, kind: str) -> str:
        from stepserve.tiny.single_file import write_denoiser_file

        name = f"{family}-{self.part(family)}" + (".gguf" if kind == "gguf" else ".safetensors")
        quant = "Q8_0" if kind == "gguf" else None
        return str(self._once((family, kind), lambda: write_denoiser_file(self.folder(family), self.part(family),
                                                                          self.root / name, quant)))

    def addon_dir(self, family: str, feature: str) -> str:
        def build():
            out = self.root / f"{family}-{feature}"
            if feature == "lora":
                from stepserve.tiny.lora import build_tiny_lora

                out.mkdir()
                build_tiny_lora(self.folder(family), out / "p.safetensors", seed=1, rank=4, std=0.3)
            elif feature == "controlnets":
                from stepserve.tiny.controlnet import build_tiny_controlnet

                build_tiny_controlnet(self.folder(family), out / "pose", seed=1, std=0.05)
            else:
                from stepserve.tiny.ipadapter import build_tiny_ip_adapter

                build_tiny_ip_adapter(self.folder(family), out / "face", seed=1, std=0.2)
            return str(out)
        return self._once((family, feature, "dir"), build)


def engine_config(tiny: Tiny, family: str, features: set[str]):
    """(EngineConfig, its --offload mode or None) for a server of `family` with the start-up `features` ("cache":
    the server's default) and the add-on folders of the request ones."""
    from stepserve.backends.fast_path import FastPathOptions
    from stepserve.engine.config import EngineConfig, EngineOptions
    from stepserve.pipelines.weights import Weights

    weights = Weights(part=tiny.part(family))
    if "quantize" in features:
        weights = replace(weights, quantize="int8wo")
    for kind in ("single_file", "gguf"):
        if kind in features:
            weights = replace(weights, denoiser=tiny.weights_file(family, kind))
    fast = None
    if features & {"deterministic", "compile"}:
        # compiled: one bucket (every batch padded to 8 rows), so that start-up traces one shape, not four
        fast = FastPathOptions(deterministic="deterministic" in features, compile="compile" in features,
                               compile_backend="aot_eager", progress=False,
                               batch_buckets=(8,) if "compile" in features else None)
    dirs = {f"{name}_dir": tiny.addon_dir(family, feature) if feature in features else None
            for feature, name in (("lora", "lora"), ("controlnets", "controlnet"), ("ip_adapter", "ip_adapter"))}
    offload = next((m for m in ("model", "group") if f"offload_{m}" in features), None)
    weights = replace(weights, offload=offload)
    config = EngineConfig(model=str(tiny.folder(family)), weights=weights, fast_path=fast, memory_cap=False,
                          warm_up=False, cache="fbcache" if "cache" in features else None, options=EngineOptions(strategy="continuous", max_batch_size=4), **dirs)
    return config, offload


def request(family: str, features: set[str], i: int) -> SamplingParams:
    """Request `i` of `family` with the request `features` (none: a plain one)."""
    size = 32 if family == "wan" else 16
    extra: dict = {"sampler": "flow_euler" if family == "flux" else "dpmpp_2m" if family == "sd" else None}
    if "video" in features:
        extra["num_frames"] = 5
    if "lora" in features:
        extra["loras"] = [{"name": "p", "scale": 0.8}]
    if "controlnets" in features:
        extra["controls"] = [{"name": "pose", "image": start_image(10 + i), "scale": 0.8}]
    if "ip_adapter" in features:
        extra["ip_adapter"] = {"name": "face", "image": start_image(50 + i, size=24), "scale": 0.6}
    for policy in ("fbcache", "deepcache", "magcache"):
        if policy in features:
            extra["cache"] = policy
    if features & {"img2img", "inpaint"}:
        extra.update(image=start_image(30 + i), strength=0.7)
    if "inpaint" in features:
        extra["mask_image"] = mask_image(i)
    return SamplingParams(prompt=f"a small cat {i}", seed=900 + i, num_inference_steps=4, guidance_scale=4.0,
                          height=size, width=size, **{k: v for k, v in extra.items() if v is not None})
