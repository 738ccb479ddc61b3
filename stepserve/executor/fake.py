"""`--model fake`: a simulated accelerator for `stepserve serve` (and its Ray replicas, and `Engine`).

No network runs. Each stage sleeps for what a measured latency model (`--latency-model FILE`, e.g. one of
stepserve/models/latency/*.json) charges at its batch, as the simulator's engines charge it on their clock
(costs/charges.py), and each image is a cheap deterministic picture of its request: a palette PNG whose colour
comes from the seed and whose band moves with the request's own denoising history. The engine, its policies, the
HTTP API, jobs, webhooks, the console and the Ray fleet run as with a real model, so a fleet, its router and its
autoscaler can be rehearsed on machines without accelerators (docs/SCALING.md, "Rehearse a fleet").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..costs import FakeExecutor, LatencyModel
from ..costs.charges import LatencyCharges
from ..costs.fake import model_for
from ..request.types import Request

FAKE = "fake"  # the model argument that names it


def is_fake(model: Any) -> bool:
    return str(model) == FAKE


def picture(request: Request):
    """The request's image: its size, a background colour from its seed, a band placed by its final latent (so
    two requests of one seed but different steps differ). A palette image encodes to PNG in a few ms even at
    1024x1024."""
    from PIL import Image

    p = request.params
    w, h = int(p.width or 64), int(p.height or 64)
    seed = int(p.seed or 0)
    colour = [(seed * 2654435761 >> s) & 0xFF for s in (0, 8, 16)]
    image = Image.new("P", (w, h), 0)
    image.putpalette(colour + [255 - c for c in colour])
    top = int(abs(float(request.latents or 0.0)) * 7919) % max(h, 1)
    image.paste(1, (0, top, w, min(h, top + max(h // 8, 1))))
    return image


class PictureFake(FakeExecutor):
    """The fake executor on the wall clock (it sleeps what it charges) that decodes pictures."""

    def decode(self, requests: list[Request]) -> float:
        seconds = super().decode(requests)
        for r in requests:
            r.image = picture(r)
        return seconds

    def preview(self, request: Request):
        return picture(request)


def check_fake(config) -> None:
    """ValueError for a setting the fake cannot honour (an engine/config.EngineConfig): another backend, a weights
    file, add-on folders or a parallel degree (it runs no network). Its device and dtype are not used."""
    asked = [flag for flag, on in (
        (f"--backend {config.backend}", config.backend != "torch"),
        ("--transformer/--unet FILE or --quantize", config.weights is not None and config.weights.changed),
        ("--lora-dir", config.lora_dir), ("--controlnet-dir", config.controlnet_dir),
        ("--ip-adapter-dir", config.ip_adapter_dir),
        ("a parallel degree", config.degrees is not None and config.degrees.enabled)) if on]
    if asked:
        raise ValueError(f"model 'fake' runs no network: {', '.join(asked)} cannot apply to it; allowed with it: "
                         "--latency-model FILE and the batching, server and replica flags")


def fake_executor(latency: LatencyModel | str | None) -> PictureFake:
    """The simulated accelerator charging `latency` (a LatencyModel or its file). ValueError when there is none:
    the fake has no speed of its own to measure."""
    if latency is None or latency == "measure":
        raise ValueError("model 'fake' sleeps for what a latency model charges: give --latency-model FILE (a file "
                         "from `stepserve profile`, or one of stepserve/models/latency/*.json)")
    if not isinstance(latency, LatencyModel):
        try:
            latency = LatencyModel.load(latency)
        except OSError as exc:
            raise ValueError(f"--latency-model {latency}: {exc}") from None
    return PictureFake(replace(model_for(latency), name=FAKE, family=FAKE), LatencyCharges(latency), sleep=True)
