"""`stepserve serve --replicas 1 --autoscale 1:2 --slo-p95-ms X` live: does the SLO policy grow the fleet under a
step of load and shrink it after, answering every request?

A local Ray cluster on loopback serves the model (one thread per replica). The load: open-loop Poisson requests
at --rate for --load-s seconds, then nothing for --quiet-s. Every --poll-s the replicas serving are counted from
/metrics (each live replica's samples carry its `replica` label). Printed: the replica count over time, when it
reached 2 and when it came back to 1, and every request's status (any that is not 200 is listed).

    python benchmarks/ray_autoscale.py [--rate 12] [--load-s 90] [--quiet-s 150] [--slo-p95-ms 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import ROOT, free_port, stop_server, wait_until_healthy


async def count_replicas(client: httpx.AsyncClient) -> int | None:
    try:
        text = (await client.get("/metrics", timeout=10)).text
    except httpx.HTTPError:
        return None
    return len(set(re.findall(r'replica="([^"]+)"', text))) or None


async def run(url: str, args) -> dict:
    rng = random.Random(args.seed)
    statuses: list[int | str] = []
    counts: list[tuple[float, int | None]] = []
    start = time.monotonic()

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(steps: int) -> None:
            body = {"prompt": "seven", "num_inference_steps": steps, "seed": rng.randrange(10**6)}
            try:
                statuses.append((await client.post("/v1/images/generations", json=body)).status_code)
            except httpx.HTTPError as exc:
                statuses.append(type(exc).__name__)

        async def poll() -> None:
            while time.monotonic() - start < args.load_s + args.quiet_s:
                counts.append((round(time.monotonic() - start, 1), await count_replicas(client)))
                await asyncio.sleep(args.poll_s)

        poller = asyncio.ensure_future(poll())
        sent = []
        t = rng.expovariate(args.rate)
        while t < args.load_s:
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            sent.append(asyncio.ensure_future(one(rng.choice([4, 20, 50]))))
            t += rng.expovariate(args.rate)
        await asyncio.gather(*sent)
        await poller
    grew = next((t for t, n in counts if n and n >= 2), None)
    shrank = next((t for t, n in counts if grew is not None and t > grew and n == 1), None)
    return {"counts": counts, "grew_at_s": grew, "shrank_at_s": shrank, "requests": len(statuses),
            "not_200": [s for s in statuses if s != 200]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded")
    p.add_argument("--rate", type=float, default=12.0, help="requests/s during the load step")
    p.add_argument("--load-s", type=float, default=90.0)
    p.add_argument("--quiet-s", type=float, default=150.0)
    p.add_argument("--poll-s", type=float, default=2.0)
    p.add_argument("--slo-p95-ms", type=float, default=2000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/ray-autoscale"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--model", args.model, "--port", str(port), "--threads", "1",
           "--replicas", "1", "--autoscale", "1:2", "--slo-p95-ms", str(args.slo_p95_ms), "--log-level", "warning"]
    log = open(args.out / "server.log", "a")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, "autoscale", timeout_s=240, poll_s=0.5, log=log.name)
        result = asyncio.run(run(url, args))
    finally:
        stop_server(proc, grace_s=120)
    (args.out / "autoscale.json").write_text(json.dumps(result, indent=1) + "\n")
    print("replicas over time (s: count):", " ".join(f"{t:g}:{n}" for t, n in result["counts"]))
    print(f"grew to 2 at {result['grew_at_s']} s, back to 1 at {result['shrank_at_s']} s; "
          f"{result['requests']} requests, not 200: {result['not_200'] or 'none'}")


if __name__ == "__main__":
    main()
