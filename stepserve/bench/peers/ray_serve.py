"""The Ray Serve peer: one deployment (one replica) whose handler batches with `@serve.batch`, as Ray Serve's
docs advise for batched inference (max_batch_size, batch_wait_timeout_s; max_ongoing_requests above
max_batch_size, so a full batch can be waiting at the replica). The batch runs in a thread so the replica's event
loop keeps taking requests for the next batch meanwhile (@serve.batch runs one batch at a time by default).

Ray stays on loopback: `ray.init(num_cpus=cores, include_dashboard=False, _node_ip_address="127.0.0.1")`, HTTP
proxy on 127.0.0.1. Run by the bench as

    python -m stepserve.bench.peers.ray_serve --port P --wait-ms 10 --max-batch-size 8 --ready-file F ...

On SIGTERM it shuts Serve and Ray down; the bench then kills whatever is left (process.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from pathlib import Path

from .handler import IMAGES_PATH, BatchHandler, HandlerOptions, PeerRequestError, add_handler_args, options_from

MAX_ONGOING_REQUESTS = 1000  # per replica; requests beyond it would queue in Ray's router instead


def build_app(options: HandlerOptions, wait_s: float):
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    @serve.deployment(num_replicas=1, max_ongoing_requests=max(MAX_ONGOING_REQUESTS, 2 * options.max_batch_size),
                      ray_actor_options={"num_cpus": 0})
    class StepservePeer:
        def __init__(self) -> None:
            self.handler = BatchHandler(options)

        async def __call__(self, request: Request):
            if request.method != "POST" or request.url.path.rstrip("/") != IMAGES_PATH:
                return JSONResponse(PeerRequestError(f"only POST {IMAGES_PATH}", 404).body(), status_code=404)
            try:
                params = self.handler.parse(await request.body())
            except PeerRequestError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
            answer = await self.generate(params)
            return JSONResponse(answer, status_code=500 if "error" in answer else 200)

        @serve.batch(max_batch_size=options.max_batch_size, batch_wait_timeout_s=wait_s)
        async def generate(self, batch: list) -> list:
            return await asyncio.to_thread(self.handler.run, batch)

    return StepservePeer.bind()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stepserve.bench.peers.ray_serve")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--wait-ms", type=float, required=True, help="@serve.batch batch_wait_timeout_s, in ms")
    p.add_argument("--ready-file", type=Path, required=True)
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1)
    add_handler_args(p)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(options_from(args), args.wait_ms / 1000.0), name="stepserve-peer", route_prefix="/")
        args.ready_file.write_text("ready\n")
        print(f"ray serve peer: serving on 127.0.0.1:{args.port}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
