"""An engine thread that dies answers every pending request with an error, and the server says it is unhealthy."""

from __future__ import annotations

import httpx
from server_helpers import GENERATIONS, assert_error_shape


def test_dead_engine_fails_pending_requests_and_health_turns_503(serve, caplog):
    with serve(strategy="continuous", max_batch_size=2) as server:
        engine = server.engine

        def broken_step(now):
            raise RuntimeError("injected core fault")

        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
            engine.core.step = broken_step
            pending = http.post(GENERATIONS, json={"prompt": "a", "seed": 1, "num_inference_steps": 3})
            error = assert_error_shape(pending, 500)
            assert "internal engine error" in error["message"] and "injected core fault" in error["message"]
            health = http.get("/health")
            assert health.status_code == 503
            # a reason code, not the exception's text (that goes to the log only)
            assert health.json()["status"] == "failed" and health.json()["reason"] == "engine_failed"
            assert "injected core fault" not in health.text and "error" not in health.json()
            assert "injected core fault" in caplog.text
            refused = assert_error_shape(http.post(GENERATIONS, json={"prompt": "b", "seed": 2}), 503)
            assert refused["code"] == "engine_failed"
