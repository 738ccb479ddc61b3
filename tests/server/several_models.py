"""A server of several models built in this process from serve's flags (the tests of tests/models/)."""

import contextlib
import io

import numpy as np
from PIL import Image

from stepserve.commands.serve import build_parser, check_model, serve_settings
from stepserve.commands.serve_models import build_front, models_config


def tiny_flux(root):
    from stepserve.tiny.flux import build_tiny_flux

    return build_tiny_flux(root / "pipe", variant="dev")


@contextlib.contextmanager
def front_of(*flags: str):
    """Serving on a thread; yields (its ServerThread, its Front). Closed at the end."""
    from server_helpers import ServerThread

    parser = build_parser()
    args = parser.parse_args(["--no-memory-cap", "--state", "memory", *flags])
    front = build_front(args, models_config(args, serve_settings, check_model, parser), serve_settings)
    try:
        with ServerThread(front.app) as server:
            yield server, front
    finally:
        front.close()


def body_of(model: str, p) -> dict:
    """The JSON body of a generation for SamplingParams `p` naming `model`."""
    body = {"model": model, "prompt": p.prompt, "seed": p.seed, "num_inference_steps": p.num_inference_steps,
            "guidance_scale": p.guidance_scale, "size": f"{p.width}x{p.height}", "response_format": "b64_json"}
    if p.sampler:
        body["sampler"] = p.sampler
    if p.negative_prompt:
        body["negative_prompt"] = p.negative_prompt
    return body


def image_of(answer: dict) -> np.ndarray:
    import base64

    png = base64.b64decode(answer["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
