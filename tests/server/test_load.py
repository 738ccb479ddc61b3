"""Under load: batch invariance through HTTP for every strategy, clients that hang up, honest 429s."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
from server_helpers import GENERATIONS, assert_close, assert_error_shape, decode_png, raw_post, read_headers, \
    wait_until
from step_gate import SteppedExecutor

from stepserve.api import Engine
from stepserve.scheduling import STRATEGIES
from stepserve.request.types import SamplingParams
from tiny_sd import SD_SAMPLERS as SAMPLERS

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

# 12 distinct requests (steps 2-5, samplers, guidance on and off), each sent 4 times: 48 at once.
CONFIGS = [dict(prompt=f"digit {i}", seed=100 + i, num_inference_steps=2 + i % 4, sampler=SAMPLERS[i % 4],
                guidance_scale=1.0 if i % 3 else 3.0) for i in range(12)]


@pytest.fixture(scope="module")
def alone(tiny_executor):
    """Each request made alone, in-process, one at a time."""
    engine = Engine(tiny_executor, strategy="none")
    return [engine.generate([SamplingParams(**c)])[0].image for c in CONFIGS]


async def _post_all(url: str, bodies: list[dict], timeout: float = 240) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        return await asyncio.gather(*(client.post(GENERATIONS, json=b) for b in bodies))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_48_concurrent_requests_equal_alone(serve, alone, strategy):
    bodies = [CONFIGS[i % len(CONFIGS)] for i in range(48)]
    with serve(strategy=strategy, max_batch_size=8, max_queue_delay_ms=20) as server:
        responses = asyncio.run(_post_all(server.url, bodies))
        assert [r.status_code for r in responses] == [200] * 48, [r.text for r in responses if r.status_code != 200]
        for i, r in enumerate(responses):
            assert_close(decode_png(r.json()["data"][0]["b64_json"]), alone[i % len(CONFIGS)], tol=1)
        seen = max(max(r.json()["stepserve"]["images"][0]["batch_sizes"]) for r in responses)
        assert (seen == 1) if strategy == "none" else (seen > 1)


def _idle(engine) -> bool:
    return engine.running_count == 0 and engine.queue_depth == 0


# A client that hangs up is aborted within this many engine steps (steps as long as the embedded model's, below).
MAX_STEPS_AFTER_DISCONNECT = 3


class SlowSteps:
    """Wraps an executor so that every denoising step takes at least `step_s` (the embedded model's step at batch 8
    is ~30 ms), so that "within a few steps" is measured against steps of a realistic length."""

    def __init__(self, inner, step_s: float = 0.03) -> None:
        self.inner = inner
        self.model_info = inner.model_info
        self.step_s = step_s

    def prepare(self, requests):
        return self.inner.prepare(requests)

    def denoise(self, requests):
        t0 = time.monotonic()
        self.inner.denoise(requests)
        time.sleep(max(0.0, self.step_s - (time.monotonic() - t0)))
        return time.monotonic() - t0

    def decode(self, requests):
        return self.inner.decode(requests)

    def preview(self, request):
        return self.inner.preview(request)


class StepLog:
    """An on_step hook: counts engine steps that ran a batch, and notes at which count each request finished."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps = 0
        self.finished_at: dict[str, int] = {}
        self.statuses: dict[str, str] = {}

    def __call__(self, report) -> None:
        with self.lock:
            if report.batch_size:
                self.steps += 1
            for r in report.finished:
                self.finished_at[r.request_id] = self.steps
                self.statuses[r.request_id] = r.status.value

    def now(self) -> int:
        with self.lock:
            return self.steps

    def finished(self) -> int:
        with self.lock:
            return len(self.finished_at)


def _hang_up_and_count_steps(engine, log: StepLog, socks, expected: int) -> None:
    mark = log.now()
    for s in socks:
        s.close()
    # (the hook runs just after the engine's counts are updated: wait for both)
    assert wait_until(lambda: _idle(engine) and log.finished() >= expected, 240), \
        (engine.running_count, engine.queue_depth, log.statuses)
    assert len(log.finished_at) == expected, log.statuses
    assert set(log.statuses.values()) == {"cancelled"}, log.statuses
    after = {rid: at - mark for rid, at in log.finished_at.items()}
    assert max(after.values()) <= MAX_STEPS_AFTER_DISCONNECT, f"engine steps after the hang-up: {after}"


def test_streaming_clients_that_disconnect_free_their_slots(serve, tiny_executor):
    body = json.dumps({"prompt": "long", "stream": True, "partial_images": 1, "num_inference_steps": 200,
                       "guidance_scale": 1.0}).encode()
    with serve(strategy="continuous", max_batch_size=8, executor=SlowSteps(tiny_executor)) as server:
        log = StepLog()
        server.engine.on_step.append(log)
        socks = [raw_post(server.port, body) for _ in range(20)]
        for s in socks:
            assert b"200 OK" in read_headers(s).split(b"\r\n")[0]
        engine = server.engine
        assert wait_until(lambda: engine.running_count == 8, 240), "requests never started running"
        assert engine.queue_depth == 12
        _hang_up_and_count_steps(engine, log, socks, 20)
        r = httpx.post(server.url + GENERATIONS, json={"prompt": "after", "num_inference_steps": 2}, timeout=60)
        assert r.status_code == 200
        metrics = httpx.get(server.url + "/metrics").text
        assert "stepserve_cancelled_total 20.0" in metrics


def test_waiting_client_that_disconnects_is_aborted(serve, tiny_executor):
    body = json.dumps({"prompt": "long", "num_inference_steps": 200, "guidance_scale": 1.0}).encode()
    with serve(strategy="continuous", max_batch_size=2, executor=SlowSteps(tiny_executor)) as server:
        log = StepLog()
        server.engine.on_step.append(log)
        socks = [raw_post(server.port, body) for _ in range(3)]
        engine = server.engine
        assert wait_until(lambda: engine.running_count == 2 and engine.queue_depth == 1, 240)
        _hang_up_and_count_steps(engine, log, socks, 3)


def test_burst_gets_only_200_or_429_and_429_at_once(serve, tiny_executor):
    """20 requests at once on 2 slots and a queue of 2: each is admitted or refused at arrival. Every denoising step
    is held until the test has all the answers it can get without one: every 429 is among them (it never waited
    for the engine), however fast or busy the machine."""
    max_queue = 2
    body = {"prompt": "burst", "num_inference_steps": 3, "guidance_scale": 1.0}
    gate = SteppedExecutor(tiny_executor)

    async def burst(url: str, engine):
        async with httpx.AsyncClient(base_url=url, timeout=240, limits=httpx.Limits(max_connections=40)) as client:
            posts = [asyncio.ensure_future(client.post(GENERATIONS, json=body)) for _ in range(10 * max_queue)]
            try:  # every request is answered, queued, or in the held step (pytest-timeout bounds a hang)
                while sum(p.done() for p in posts) + engine.queue_depth + gate.held_requests < len(posts):
                    await asyncio.sleep(0.01)
                before_any_step = [p.result().status_code for p in posts if p.done()]
                steps = gate.steps
            finally:
                gate.free()
            return before_any_step, steps, await asyncio.gather(*posts)

    with serve(strategy="continuous", max_batch_size=2, max_queue=max_queue, executor=gate) as server:
        before_any_step, steps, results = asyncio.run(burst(server.url, server.engine))
        codes = sorted({r.status_code for r in results})
        assert codes == [200, 429], codes
        sent_429 = sum(1 for r in results if r.status_code == 429)
        assert steps == 0 and before_any_step == [429] * sent_429, (steps, before_any_step)
        for r in results:
            if r.status_code == 429:
                assert_error_shape(r)
                assert int(r.headers["Retry-After"]) >= 1
        assert wait_until(lambda: _idle(server.engine), 240)
        after = httpx.post(server.url + GENERATIONS, json=body, timeout=240)
        assert after.status_code == 200
        assert _counter(server, "stepserve_rejected_total") == sent_429
        assert _counter(server, 'stepserve_requests_total{outcome="rejected"}') == sent_429
        too_many = httpx.post(server.url + GENERATIONS, json={**body, "n": max_queue + 1})
        assert assert_error_shape(too_many, 400)["param"] == "n"  # could never fit: not a 429 to retry forever
        assert _counter(server, "stepserve_rejected_total") == sent_429  # a 400 is not a rejection


def _counter(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    found = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert len(found) == 1, (name, found)
    return float(found[0])
