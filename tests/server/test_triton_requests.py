"""The Triton entry model's request parsing, without Triton: its tensors become resolved SamplingParams (defaults
for the inputs left out), bad input is refused naming the Triton input, and images go back as (rows, H, W, C)."""

from __future__ import annotations

import numpy as np
import pytest

from stepserve.server.triton.requests import BadRequest, parse_request, stack_images


def model_info():
    from stepserve.request.types import ModelInfo

    return ModelInfo(name="m", default_sampler="dpmpp_2m", default_steps=15, default_guidance_scale=3.0,
                     default_height=32, default_width=32, size_multiple=8, min_size=32, max_size=32)


def row(value, dtype=None):
    return np.array([[value]], dtype=dtype or (object if isinstance(value, bytes) else None))


def test_a_request_becomes_sampling_params_with_defaults_for_missing_optional_inputs():
    inputs = {"prompt": row(b"a 7"), "seed": row(5, np.int64), "steps": row(4, np.int32),
              "guidance_scale": row(2.5, np.float32), "negative_prompt": None, "sampler": row(b"euler")}
    (p,) = parse_request(inputs, model_info()).params
    assert (p.prompt, p.seed, p.num_inference_steps, p.guidance_scale, p.sampler) == ("a 7", 5, 4, 2.5, "euler")
    assert (p.height, p.width, p.negative_prompt, p.timeout_s) == (32, 32, "", None)


def test_an_optional_timeout_s_input_is_the_request_deadline():
    inputs = {"prompt": row(b"a 7"), "seed": row(5, np.int64), "steps": row(4, np.int32),
              "guidance_scale": row(2.5, np.float32), "timeout_s": row(1.5, np.float32)}
    (p,) = parse_request(inputs, model_info()).params
    assert p.timeout_s == 1.5


def test_an_optional_cache_input_is_the_requests_step_caching():
    from dataclasses import replace

    model = replace(model_info(), cache_policies=("fbcache", "deepcache"))
    base = {"prompt": row(b"a 7"), "seed": row(5, np.int64), "steps": row(4, np.int32),
            "guidance_scale": row(2.5, np.float32)}
    (p,) = parse_request({**base, "cache": row(b'{"policy": "deepcache", "interval": 2}')}, model).params
    assert (p.cache.policy, p.cache.interval) == ("deepcache", 2)
    (p,) = parse_request({**base, "cache": row(b"fbcache")}, model).params
    assert (p.cache.policy, p.cache.threshold) == ("fbcache", 0.05)
    with pytest.raises(BadRequest, match="cache: policy 'magcache' does not run"):
        parse_request({**base, "cache": row(b"magcache")}, model)
    with pytest.raises(BadRequest, match="cache: not a JSON object"):
        parse_request({**base, "cache": row(b"{policy")}, model)


def test_an_optional_loras_input_names_the_requests_adapters():
    from dataclasses import replace

    model = replace(model_info(), lora_names=frozenset({"ink"}))
    base = {"prompt": row(b"a 7"), "seed": row(5, np.int64), "steps": row(4, np.int32),
            "guidance_scale": row(2.5, np.float32)}
    (p,) = parse_request({**base, "loras": row(b'[{"name": "ink", "scale": 0.5}]')}, model).params
    assert p.loras == (("ink", 0.5),)
    with pytest.raises(BadRequest, match="loras: adapter 'chalk' is not loaded; loaded: ink"):
        parse_request({**base, "loras": row(b'[{"name": "chalk"}]')}, model)


@pytest.mark.parametrize(("change", "says"), [
    ({"steps": row(0, np.int32)}, "steps: must be an integer in [1, 200]"),
    ({"sampler": row(b"plms")}, "sampler: 'plms' is not supported; allowed: ddim, euler"),
    ({"height": row(64, np.int32)}, "height: 32x64 (width x height) is not supported; allowed: 32x32 only"),
    ({"seed": None}, "seed: required input(s) missing"),
    ({"prompt": row(b"\xff")}, "prompt: must be UTF-8 text"),
    ({"timeout_s": row(0.0, np.float32)}, "timeout_s: must be a positive, finite number"),
    ({"timeout_s": row(np.inf, np.float32)}, "timeout_s: must be a positive, finite number"),
    ({"seed": np.array([[1], [2]], dtype=np.int64)}, "one element per batch row (shape [1, 1])"),
])
def test_bad_input_names_the_triton_input_and_what_is_allowed(change, says):
    inputs = {"prompt": row(b"a 7"), "seed": row(5, np.int64), "steps": row(4, np.int32),
              "guidance_scale": row(2.5, np.float32), **change}
    with pytest.raises(BadRequest) as e:
        parse_request(inputs, model_info())
    assert says in str(e.value)


def test_images_are_height_width_channels_and_rows_of_one_request_share_a_size():
    from PIL import Image

    grey = stack_images([Image.new("L", (4, 3), 7)])
    assert grey.shape == (1, 3, 4, 1) and grey.dtype == np.uint8 and grey.max() == 7
    assert stack_images([Image.new("RGB", (4, 3))] * 2).shape == (2, 3, 4, 3)
    with pytest.raises(BadRequest, match="one image size"):
        stack_images([Image.new("RGB", (4, 3)), Image.new("RGB", (3, 4))])


def test_a_palette_image_goes_back_as_its_rgb_colours_not_its_indices():
    from types import SimpleNamespace

    from stepserve.executor.fake import picture

    image = picture(SimpleNamespace(params=SimpleNamespace(seed=3, height=12, width=16), latents=0.25))
    assert image.mode == "P"  # the fake model's picture
    got = stack_images([image])
    assert got.shape == (1, 12, 16, 3)
    assert (got[0] == np.asarray(image.convert("RGB"))).all() and got.max() > 1  # colours, not palette indices


def test_other_modes_go_back_as_greyscale_or_rgb_at_full_range():
    from PIL import Image

    assert stack_images([Image.new("1", (4, 3), 1)]).max() == 255  # not 0/1
    assert stack_images([Image.new("RGBA", (4, 3), (9, 8, 7, 0))]).shape == (1, 3, 4, 3)  # alpha dropped
    assert stack_images([Image.new("LA", (4, 3), (9, 0))]).shape == (1, 3, 4, 1)
