"""The slo strategy through HTTP: refused at once with 429 + Retry-After when a deadline cannot be met; misses
and refusals counted in /metrics; the priority field accepted and validated."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import GENERATIONS, assert_error_shape

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


def test_infeasible_deadline_is_refused_at_once_with_retry_after(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post(GENERATIONS, json={"prompt": "a", "seed": 1, "num_inference_steps": 40, "timeout_s": 0.5})
        error = assert_error_shape(r, 429)
        assert error["code"] == "deadline_infeasible" and "deadline" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
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
            httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post(GENERATIONS, json={"prompt": "a", "seed": 1, "num_inference_steps": 200, "timeout_s": 0.05})
        error = assert_error_shape(r, 504)
        assert "ran" in error["message"] or "queued" in error["message"] or "too late" in error["message"]
        text = http.get("/metrics").text
    missed = sum(metric(text, f'stepserve_deadline_missed_total{{stage="{s}"}}') for s in ("queued", "running"))
    assert missed == 1
