"""The slo strategy through HTTP: refused at once with 429 + Retry-After when a deadline cannot be met; misses
and refusals counted in /metrics; the priority field accepted and validated."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_helpers import GENERATIONS, assert_error_shape, wait_until

from stepserve.costs.latency_model import Curve, LatencyModel


@pytest.fixture(scope="module")
def server(serve):
    # a model that says every step takes 50 ms: 40 steps can never finish within 0.5 s
    model = LatencyModel(step={(32, 32): Curve([(1, 0.05), (8, 0.05)])}, encode=Curve([(1, 0.0)]),
                         decode={(32, 32): Curve([(1, 0.0)])})
    with serve(strategy="slo", max_batch_size=4, latency_model=model) as s:
        yield s


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if line.startswith(name + " ") or name.endswith("}"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_a_deadline_missed_even_alone_is_a_400_and_one_missed_under_load_a_429_with_retry_after(server):
    with httpx.Client(base_url=server.url, timeout=240) as http:
        # 40 steps of 50 ms can never finish within 0.5 s, whatever the load: a retry cannot help
        r = http.post(GENERATIONS, json={"prompt": "a", "seed": 1, "num_inference_steps": 40, "timeout_s": 0.5})
        error = assert_error_shape(r, 400)
        assert error["code"] == "deadline_infeasible" and error["param"] == "timeout_s"
        assert "even alone" in error["message"] and "retry-after" not in r.headers
        # four long requests hold every slot, predicted ~10 s (and long enough in fact that they are still far
        # from done when the next one arrives, however fast the machine): 2 steps within 0.5 s fit alone, not
        # behind them
        load = threading.Thread(target=lambda: http.post(GENERATIONS, json={"prompt": "b", "seed": 2, "n": 4,
                                                                            "num_inference_steps": 200}))
        load.start()
        try:
            assert wait_until(lambda: server.engine.running_count == 4, 240)
            r = http.post(GENERATIONS, json={"prompt": "a", "seed": 1, "num_inference_steps": 2, "timeout_s": 0.5})
            error = assert_error_shape(r, 429)
            assert error["code"] == "deadline_infeasible" and "deadline" in error["message"]
            assert int(r.headers["retry-after"]) >= 1
        finally:
            load.join()
        ok = http.post(GENERATIONS, json={"prompt": "a", "seed": 1, "num_inference_steps": 2, "timeout_s": 20,
                                          "priority": 5})
        assert ok.status_code == 200, ok.text
        bad = assert_error_shape(http.post(GENERATIONS, json={"prompt": "a", "priority": 1000}), 400)
        assert bad["param"] == "priority"
        text = http.get("/metrics").text
    assert metric(text, 'stepserve_refused_at_admission_total{reason="deadline"}') == 1
    assert metric(text, "stepserve_rejected_total") == 1


def test_deadline_missed_counter_by_stage(serve):
    with serve(strategy="continuous", max_batch_size=1) as server, \
            httpx.Client(base_url=server.url, timeout=240) as http:
        r = http.post(GENERATIONS, json={"prompt": "a", "seed": 1, "num_inference_steps": 200, "timeout_s": 0.05})
        error = assert_error_shape(r, 504)
        assert "ran" in error["message"] or "queued" in error["message"] or "too late" in error["message"]
        text = http.get("/metrics").text
    missed = sum(metric(text, f'stepserve_deadline_missed_total{{stage="{s}"}}') for s in ("queued", "running"))
    assert missed == 1
