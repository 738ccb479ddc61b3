"""The embedded model is served at the one size it was trained at; any other size is a 400 naming the size asked
for and the one allowed."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import GENERATIONS, assert_error_shape, decode_png


@pytest.fixture(scope="module")
def embedded_executor():
    from stepserve.engine.loading import load_executor

    return load_executor("embedded")


def test_other_sizes_get_400_naming_the_trained_size(serve, embedded_executor):
    with serve(executor=embedded_executor, strategy="continuous", max_batch_size=4) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for size in ("64x64", "48x48", "32x48", "16x32", "24x32"):
                error = assert_error_shape(http.post(GENERATIONS, json={"prompt": "7", "size": size}), 400)
                assert error["param"] == "size", error
                assert error["message"] == (f"size: {size} is not supported; allowed: 32x32 only (embedded was trained "
                                            f"at that size); 'auto' gives the model's default 32x32"), error
            for size in ("32x32", "auto"):
                r = http.post(GENERATIONS, json={"prompt": "7", "size": size, "num_inference_steps": 2, "seed": 1})
                assert r.status_code == 200, r.text
                assert decode_png(r.json()["data"][0]["b64_json"]).size == (32, 32)
