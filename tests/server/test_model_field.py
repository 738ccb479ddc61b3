"""The body's "model" is type-checked and otherwise ignored: the server answers with the one model it serves."""

from __future__ import annotations

import httpx
from server_helpers import GENERATIONS, assert_error_shape, decode_png


def test_model_value_is_ignored_and_not_echoed(serve):
    with serve(strategy="continuous", max_batch_size=2) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"prompt": "seven", "seed": 2, "num_inference_steps": 2, "guidance_scale": 1.0}
            plain = http.post(GENERATIONS, json=body)
            named = http.post(GENERATIONS, json={**body, "model": "no-such-model"})
            assert plain.status_code == named.status_code == 200, named.text
            assert "no-such-model" not in named.text
            assert named.json()["stepserve"]["model"] == server.engine.model_info.name
            assert decode_png(named.json()["data"][0]["b64_json"]).tobytes() == \
                decode_png(plain.json()["data"][0]["b64_json"]).tobytes()
            assert assert_error_shape(http.post(GENERATIONS, json={**body, "model": 5}), 400)["param"] == "model"
