"""A rehearsed fleet: `serve --model fake --latency-model FILE --replicas 3` behind Ray Serve's real proxy, router
(least_work: the default from 3 replicas up) and controller. A burst of requests that say their work in the
x-stepserve-* headers is answered in full, spread over the replicas, each image at its asked size; an async job
goes through the proxy too, found by whichever replica a poll reaches (one state store)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from extras import require
from server_helpers import GENERATIONS, decode_png, wait_until

from stepserve.fleet.headers import work_headers

LATENCY = Path(__file__).resolve().parents[2] / "stepserve/models/latency/gpu-sd15-512.json"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fake_fleet_of_three_answers_a_burst_spread_over_its_replicas(tmp_path):
    import httpx
    from ray_cluster import Cluster, ServeProcess

    require("ray", "ray")
    cluster = Cluster(uuid.uuid4().hex)
    server = None
    try:
        server = ServeProcess(cluster.mark, "--latency-model", str(LATENCY), "--replicas", "3", "--replica-cpus",
                              "0.25", "--ray-address", cluster.address, "--state",
                              f"sqlite:///{tmp_path / 'state.db'}", "--results", str(tmp_path / "results"),
                              "--shutdown-grace-s", "2", model="fake")
        server.wait_ready()

        async def burst():
            async with httpx.AsyncClient(timeout=300) as client:
                async def one(i: int):
                    steps, size = (50, "512x512") if i % 2 else (4, "256x256")
                    w, h = map(int, size.split("x"))
                    return await client.post(server.url + GENERATIONS, headers=work_headers(steps, w, h),
                                             json={"prompt": "x", "seed": i, "num_inference_steps": steps,
                                                   "size": size})
                return await asyncio.gather(*(one(i) for i in range(9)))

        answers = asyncio.run(burst())
        for i, r in enumerate(answers):
            assert r.status_code == 200, (r.status_code, r.text[:300], server.tail())
            assert decode_png(r.json()["data"][0]["b64_json"]).size == ((512, 512) if i % 2 else (256, 256))
        assert len({r.headers["X-Stepserve-Replica"] for r in answers}) >= 2, [r.headers for r in answers]
        with httpx.Client(timeout=60) as client:
            job = client.post(server.url + GENERATIONS, json={"prompt": "x", "num_inference_steps": 3},
                              headers={"Prefer": "respond-async"})
            assert job.status_code == 202, job.text
            url = server.url + job.headers["location"]
            # the replicas share the state store: whichever one a poll reaches finds the job
            assert wait_until(lambda: client.get(url).json().get("status") == "completed", 600), client.get(url).text
    finally:
        if server is not None:
            assert server.stop() == 0, server.tail()
            server.log.close()
        cluster.close()
