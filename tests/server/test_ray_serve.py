"""`stepserve serve --replicas N`: the engine as a Ray Serve deployment, checked through Ray's HTTP proxy.

One Ray cluster (ray.init in a helper process, loopback only) serves the module; `stepserve serve --replicas 2
--ray-address ...` joins it, two replicas of the embedded model on one thread each. The local-cluster mode (no
--ray-address) gets its own short run. Every process a test starts is found again by a marker in its environment
and must be gone at the end.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
from extras import require
from ray_cluster import Cluster, ServeProcess, assert_all_gone, free_port, marked_pids, ray_env
from server_helpers import GENERATIONS, assert_close, assert_error_shape, decode_png

from stepserve.commands.serve import main as serve_main

# the first test of the module also starts Ray and its replicas, slow on a busy machine (a hang bound only)
pytestmark = pytest.mark.timeout(900)

# 12 distinct requests (steps 2-5, two samplers, guidance on and off)
CONFIGS = [dict(prompt=f"digit {i % 10}", seed=300 + i, num_inference_steps=2 + i % 4,
                sampler=("euler", "ddim")[i % 2], guidance_scale=1.0 if i % 3 else 3.0) for i in range(12)]


@pytest.fixture(scope="module")
def local_server():
    """`stepserve serve --replicas 1` with no --ray-address (its own local cluster), started before the module's
    cluster so that the two boot side by side; test_local_cluster_* uses it last."""
    require("ray", "ray")
    mark = uuid.uuid4().hex
    env = {k: v for k, v in ray_env(mark).items()
           if k not in ("RAY_AUTH_MODE", "STEPSERVE_WEBHOOK_SECRET")}  # stepserve's own default applies
    # the webhook secret as a flag: it never travels to the replica, which finds it in the environment it inherits
    # and the webhook receiver below is on loopback, which webhooks reach only when it is named
    server = ServeProcess(mark, "--replicas", "1", "--shutdown-grace-s", "2", "--webhook-secret", "local-secret",
                          "--webhook-allow", "127.0.0.1", env=env)
    try:
        yield server, mark
    finally:
        server.stop()
        server.log.close()
        assert_all_gone(mark)


@pytest.fixture(scope="module")
def cluster(local_server):
    cluster = Cluster(uuid.uuid4().hex)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def replicas(cluster):
    server = ServeProcess(cluster.mark, "--replicas", "2", "--ray-address", cluster.address, "--max-batch-size", "4",
                          "--max-queue", "8", "--max-ongoing-requests", "8", "--max-queued-requests", "40",
                          "--shutdown-grace-s", "5")
    try:
        server.images = single_process_server_images()  # while the replicas boot
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.tail()
        server.log.close()


@pytest.fixture(scope="module")
def single_process_images(replicas):
    return replicas.images


def single_process_server_images() -> list:
    """CONFIGS through the single-process server (the same app, uvicorn in this process)."""
    from server_helpers import ServerThread

    from stepserve.engine.loading import load_executor
    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.server.app import create_app

    app = create_app(AsyncEngine(load_executor("embedded"), max_batch_size=4))
    with ServerThread(app) as server:
        responses = asyncio.run(post_all(server.url, CONFIGS))
    assert [r.status_code for r in responses] == [200] * len(CONFIGS)
    return [decode_png(r.json()["data"][0]["b64_json"]) for r in responses]


async def post_all(url: str, bodies: list[dict], timeout: float = 240) -> list:
    """Every request's response, or the exception it ended with (a client timeout proves a hang)."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        return await asyncio.gather(*(client.post(GENERATIONS, json=b) for b in bodies), return_exceptions=True)


async def answers_until_only_fit_are_left(url: str, body: dict, count: int, fit: int) -> list:
    """`count` copies of `body` at once; once no more than `fit` are unanswered (all that Ray can hold: in flight
    and queued), the rest are cancelled (the client hangs up: Ray and the replicas drop them). The answers (or the
    exceptions) of those answered by then."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=240, limits=limits) as client:
        posts = [asyncio.ensure_future(client.post(GENERATIONS, json=body)) for _ in range(count)]
        while sum(p.done() for p in posts) < count - fit:
            await asyncio.sleep(0.05)
        answered = [p for p in posts if p.done()]
        for p in posts:
            p.cancel()
        await asyncio.gather(*posts, return_exceptions=True)
    return [p.exception() or p.result() for p in answered]


def test_40_concurrent_all_200_on_both_replicas_same_images_as_one_process(replicas, single_process_images):
    bodies = [CONFIGS[i % len(CONFIGS)] for i in range(40)]
    responses = asyncio.run(post_all(replicas.url, bodies))
    assert [getattr(r, "status_code", r) for r in responses] == [200] * 40
    served_by = {r.headers["X-Stepserve-Replica"] for r in responses}
    assert len(served_by) == 2, served_by
    for i, r in enumerate(responses):
        assert_close(decode_png(r.json()["data"][0]["b64_json"]), single_process_images[i % len(CONFIGS)], tol=1)


def test_streaming_through_ray(replicas, single_process_images):
    body = {**CONFIGS[3], "stream": True, "partial_images": 2}
    with httpx.stream("POST", replicas.url + GENERATIONS, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["X-Stepserve-Replica"]
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e["partial_image_index"] for e in events[:2]] == [0, 1]
    assert_close(decode_png(events[-1]["b64_json"]), single_process_images[3], tol=1)


def test_metrics_aggregate_replicas_with_a_replica_label(replicas):
    responses = asyncio.run(post_all(replicas.url, CONFIGS * 2))
    seen = {r.headers["X-Stepserve-Replica"] for r in responses if r.status_code == 200}
    assert len(seen) == 2 and all(r.status_code == 200 for r in responses)
    deadline = time.monotonic() + 120  # bounds a hang only
    while True:  # the other replica's snapshot is at most a second old
        text = httpx.get(replicas.url + "/metrics", timeout=30).text
        completed = {rep: _sample(text, f'stepserve_requests_total{{outcome="completed",replica="{rep}"}}')
                     for rep in seen}
        if all(v and v > 0 for v in completed.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(v and v > 0 for v in completed.values()), completed
    assert text.count("# TYPE stepserve_requests_total counter") == 1  # one family, one sample per replica


def _sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def engine_steps(url: str) -> float:
    """Engine steps so far, summed over the replicas (each replica's view is <= 1 s old)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stepserve_step_batch_size_count"))


def engine_steps_settled(url: str) -> float:
    """Engine steps once they stopped changing over two pushes of every replica: nothing runs any more."""
    seen = [engine_steps(url)]
    while len(seen) < 3 or seen[-1] != seen[-3]:
        time.sleep(1.0)
        seen.append(engine_steps(url))
    return seen[-1]


def test_a_client_that_hangs_up_frees_its_slots_in_the_replica(replicas):
    """Ray Serve cancels the replica's handler when its client goes away; the handler aborts the requests, so the
    engine stops stepping them instead of running them to the end (as in one process: test_load.py)."""
    from server_helpers import raw_post

    before = engine_steps_settled(replicas.url)
    # 8 images of 200 steps, 4 at a time: 400 steps had they run to the end
    body = json.dumps({"prompt": "long", "n": 8, "num_inference_steps": 200, "guidance_scale": 1.0}).encode()
    sock = raw_post(replicas.port, body)
    deadline = time.monotonic() + 240  # bounds a hang only
    while engine_steps(replicas.url) == before and time.monotonic() < deadline:  # they started
        time.sleep(0.05)
    sock.close()
    ran = engine_steps_settled(replicas.url) - before
    assert 0 < ran < 300, f"{ran:g} engine steps for 8 requests of 200 steps whose client hung up"


def test_ray_queue_limit_is_a_429_with_retry_after_and_replica_429s_pass_through(replicas):
    slow = {"prompt": "burst", "num_inference_steps": 20, "guidance_scale": 1.0}
    # 200 at once: 2 replicas x 8 in flight + 40 in Ray's queue fit; the rest Ray refuses at once. The burst's
    # requests are long (200 steps with guidance: two rows a step), so the replicas cannot drain the queue while a
    # client slowed by the shared cores is still sending (150 steps without guidance drained in some runs, and a
    # burst of 100 once never overflowed the queue in a full suite run: the client sent them too slowly).
    burst = {**slow, "num_inference_steps": 200, "guidance_scale": 3.0}
    # the 56 that fit would run 200 guided steps each, 8 at a time per replica: minutes on a slow, shared 2-core
    # machine; they are not what this test is about: once only they are left unanswered, the client hangs up
    responses = asyncio.run(answers_until_only_fit_are_left(replicas.url, burst, 200, fit=2 * 8 + 40))
    codes = [getattr(r, "status_code", r) for r in responses]
    assert set(codes) <= {200, 429}, codes
    ray_429 = [r for r in responses if r.status_code == 429]
    assert ray_429, "Ray's queue limit never answered"
    for r in ray_429:
        error = assert_error_shape(r)
        assert error["type"] == "rate_limit_error" and "max_queued_requests" in error["message"], error
        assert int(r.headers["Retry-After"]) >= 1 and "X-Stepserve-Replica" not in r.headers
    engine_steps_settled(replicas.url)  # the burst's requests the client hung up on are gone from every replica
    # 16 requests of 3 images each fit Ray's in-flight limit but not the engines (4 running + 8 waiting images
    # each, --max-queue 8): the replicas refuse some themselves, and their 429s reach the client as they left it.
    responses = asyncio.run(post_all(replicas.url, [{**slow, "n": 3}] * 16))
    codes = [getattr(r, "status_code", r) for r in responses]
    assert set(codes) <= {200, 429} and 429 in codes, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["X-Stepserve-Replica"] and int(r.headers["Retry-After"]) >= 1
            assert assert_error_shape(r)["code"] == "queue_full"
            assert "max_queued_requests" not in r.json()["error"]["message"]


def test_killing_a_replica_mid_load_loses_no_request_silently(replicas, cluster):
    body = {"prompt": "kill", "num_inference_steps": 40, "guidance_scale": 1.0}

    async def load_then_kill():
        task = asyncio.ensure_future(post_all(replicas.url, [{**body, "seed": i} for i in range(24)], timeout=60))
        first = httpx.AsyncClient(base_url=replicas.url, timeout=60)
        async with first:
            victim = (await first.post(GENERATIONS, json={**body, "num_inference_steps": 2})).headers[
                "X-Stepserve-Replica"]
        await asyncio.to_thread(cluster.kill, victim)
        return victim, await task

    victim, responses = asyncio.run(load_then_kill())
    hung = [r for r in responses if isinstance(r, Exception)]
    assert not hung, f"requests ended without an answer: {hung[:3]}"
    assert all(r.status_code == 200 or r.status_code >= 500 for r in responses), [r.status_code for r in responses]
    assert any(r.status_code == 200 for r in responses)
    for r in responses:
        if r.status_code >= 500:
            assert_error_shape(r)
    # Ray replaces the dead replica; the service answers throughout
    after = httpx.post(replicas.url + GENERATIONS, json={**body, "num_inference_steps": 2}, timeout=60)
    assert after.status_code == 200 and after.headers["X-Stepserve-Replica"] != victim


def test_local_cluster_serves_and_stops_without_leftovers(local_server):
    server, mark = local_server
    server.wait_ready()
    r = httpx.post(server.url + GENERATIONS, json=CONFIGS[0], timeout=60)
    assert r.status_code == 200 and r.headers["X-Stepserve-Replica"]
    # the replica signs webhooks (without a secret a job naming one is a 400)
    job = httpx.post(server.url + GENERATIONS, json={**CONFIGS[0], "webhook": "http://127.0.0.1:9/hook"},
                     headers={"Prefer": "respond-async"}, timeout=60)
    assert job.status_code == 202, job.text
    assert len(marked_pids(mark)) > 3  # the CLI, Ray's own processes and the replica
    assert server.stop() == 0, server.tail()
    assert_all_gone(mark)
    # its log (a file here) is plain text without Ray's warnings the user cannot act on, and the cluster's
    # session folder is gone with it
    log = Path(server.log.name).read_text()
    assert "\x1b[" not in log and "Token authentication is" not in log, log[-3000:]
    assert "graceful_shutdown failed" not in log and "killed by `ray.kill`" not in log, log[-3000:]
    session = re.search(r"the cluster's logs are in (\S+)/logs until it stops", log)
    assert session and not Path(session.group(1)).exists(), log[-3000:]


@pytest.mark.parametrize("flags, message", [
    (["--replica-cpus", "1"], "--replica-cpus only apply to Ray Serve replicas"),
    (["--replicas", "3"], "3 replicas at 1 CPU each: 3 CPUs in all, but this machine has 2"),
    (["--replicas", "5", "--autoscale", "1:4"], "--replicas 5 is outside --autoscale 1:4"),
    (["--replicas", "2", "--target-ongoing-requests", "4"], "add --autoscale"),
    (["--replicas", "1", "--replica-gpus", "1"], "add --device cuda"),
])
def test_bad_replica_flags_get_one_line_errors(flags, message, capsys, monkeypatch):
    monkeypatch.setattr("stepserve.commands.serve.available_cores", lambda: 2)
    assert serve_main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("stepserve serve: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("text", ["4", "0:2", "3:2", "a:b", "1:"])
def test_autoscale_flag_is_checked(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_main(["--replicas", "1", "--autoscale", text])
    assert exit_.value.code == 2 and "expected MIN:MAX" in capsys.readouterr().err


def test_flags_map_to_ray_serve_options():
    from stepserve.commands.serve import build_parser
    from stepserve.server.ray.options import deployment_options, plan_replicas

    args = build_parser().parse_args(["--replicas", "2", "--autoscale", "1:4", "--replica-cpus", "0.5",
                                      "--max-batch-size", "6", "--max-queued-requests", "10"])
    options = deployment_options(plan_replicas(args, local_cores=2))
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                             "target_ongoing_requests": 6.0}
    assert "num_replicas" not in options
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert options["max_ongoing_requests"] == 12 and options["max_queued_requests"] == 10
    assert options["backpressure_config"]["status_code"] == 429


def test_a_state_that_cannot_be_opened_is_one_line_before_a_cluster_starts(monkeypatch, capsys):
    require("redis", "redis")
    monkeypatch.setattr("stepserve.commands.serve.available_cores", lambda: 2)
    monkeypatch.setattr("stepserve.server.ray.deployment.serve_replicas", lambda *_: pytest.fail("a cluster started"))
    assert serve_main(["--replicas", "1", "--state", "redis://127.0.0.1:1/0", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stepserve serve: error: --state redis://127.0.0.1:1/0") and err.count("\n") == 1, err
    assert "cannot reach Redis at 127.0.0.1:1" in err


def test_memory_state_with_replicas_warns_once_that_nothing_is_shared(monkeypatch, capsys):
    started = []
    monkeypatch.setattr("stepserve.commands.serve.available_cores", lambda: 2)
    monkeypatch.setattr("stepserve.server.ray.deployment.serve_replicas", lambda *args: started.append(args) or 0)
    assert serve_main(["--replicas", "2", "--state", "memory", "--port", str(free_port())]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: with --state memory each replica keeps its own jobs and adapters") == 1, err
    [(settings, plan, models)] = started
    assert settings.state_url == "memory" and plan.replicas == 2 and models is None  # one model
