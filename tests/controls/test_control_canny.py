"""`"preprocess": "canny"`: the server makes the control map from a photo. The map is OpenCV's Canny of the
photo's grayscale at thresholds 100/200, as three channels; a request that sends the photo with it gets the image
of the same request sending that map itself; a preprocessor that does not exist is refused by field."""

import numpy as np
import pytest
from control_reference import build_controlnets
from edit_images import pixels, start_image

from stepserve import Engine, SamplingParams, ValidationError

from extras import require


@pytest.fixture(scope="module")
def engine(tiny_sd_path, tmp_path_factory):
    folder = build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets_canny"))
    return Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", controlnet_dir=str(folder))


def photo():
    """A photo-like picture with edges to find: a bright square on a dark ground, with some noise."""
    rng = np.random.default_rng(5)
    a = np.full((32, 32, 3), 30.0) + rng.normal(0, 4, (32, 32, 3))
    a[8:24, 10:26] += 180
    return np.clip(a, 0, 255).astype(np.uint8)


def test_the_canny_map_is_opencvs_edges_of_the_grayscale():
    cv2 = require("cv2", "canny")
    from PIL import Image

    from stepserve.controls.preprocess import canny

    got = np.asarray(canny(Image.fromarray(photo())))
    want = cv2.Canny(cv2.cvtColor(photo(), cv2.COLOR_RGB2GRAY), 100, 200)
    assert got.shape == (32, 32, 3) and all((got[..., c] == want).all() for c in range(3))
    assert 0 < (want > 0).mean() < 0.5  # it found edges, not everything


def test_a_photo_with_canny_serves_what_its_map_serves(engine):
    require("cv2", "canny")
    from PIL import Image

    from stepserve.controls.preprocess import canny

    edge_map = canny(Image.fromarray(photo()))

    def req(control):
        return SamplingParams(prompt="a square", seed=11, num_inference_steps=4, height=16, width=16,
                              guidance_scale=4.0, sampler="dpmpp_2m", controls=[{"name": "edge", **control}])

    by_server, by_client, raw = engine.generate([req({"image": photo(), "preprocess": "canny"}),
                                                 req({"image": edge_map}), req({"image": photo()})])
    assert by_server.ok and by_client.ok and raw.ok
    assert np.array_equal(pixels(by_server.image), pixels(by_client.image))
    assert not np.array_equal(pixels(by_server.image), pixels(raw.image))  # the map, not the photo, was used


def test_an_unknown_preprocessor_is_refused_by_field(engine):
    bad = SamplingParams(prompt="a cat", seed=1, num_inference_steps=4, height=16, width=16,
                         controls=[{"name": "edge", "image": start_image(0), "preprocess": "depth"}])
    with pytest.raises(ValidationError) as info:
        engine.generate([bad])
    assert info.value.field == "controls[0].preprocess" and "allowed: canny" in str(info.value)
