"""HTTP overhead: one request through the HTTP server (idle) vs Engine.generate in-process, same model and settings.

Both sides share one loaded executor in one process; the server (uvicorn + the app over an AsyncEngine) runs in a
background thread and a plain httpx client posts to it over loopback. Runs alternate (in-process, HTTP, ...) so
that load drifting on a shared machine hits both alike. The HTTP side includes everything a client pays for:
JSON parsing and validation, the engine thread hand-off, PNG encoding, base64 and the response body.
The last line printed is a JSON summary: medians of each side, their difference (overhead_ms, overhead_pct), the
median of the per-pair differences (paired_overhead_ms), and whether the overhead is within max(5 ms, 5%).

    python benchmarks/http_overhead.py [--model auto|embedded|PATH] [--repeats 20] [--steps N] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time

from common import pick_model


class Server:
    def __init__(self, app) -> None:
        import uvicorn

        # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY on accepted connections only for such sockets
        # (with proto 0, Nagle + delayed ACKs add ~40 ms to every response).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="auto", help="auto (embedded if installed, else a tiny random SD), "
                                                    "embedded, or a diffusers folder")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on shared CPUs)")
    args = ap.parse_args(argv)

    import httpx
    import torch

    from stepserve import Engine, SamplingParams
    from stepserve.engine.loading import load_executor
    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.server.app import create_app

    torch.set_num_threads(args.threads)
    model = pick_model(args.model)
    executor = load_executor(model)
    info = executor.model_info
    steps = args.steps or info.default_steps
    body = {"prompt": "a handwritten 7", "seed": 1, "num_inference_steps": steps}
    params = SamplingParams(prompt=body["prompt"], seed=1, num_inference_steps=steps)
    engine = Engine(executor, strategy="continuous")
    app = create_app(AsyncEngine(executor, strategy="continuous"))
    local, remote = [], []
    with Server(app) as server, httpx.Client(base_url=server.url, timeout=600) as client:
        for i in range(args.warmup + args.repeats):
            t0 = time.perf_counter()
            result = engine.generate([params])[0]
            t1 = time.perf_counter()
            response = client.post("/v1/images/generations", json=body)
            t2 = time.perf_counter()
            assert result.ok and response.status_code == 200, response.text
            if i >= args.warmup:
                local.append((t1 - t0) * 1000)
                remote.append((t2 - t1) * 1000)
                print(f"run {i - args.warmup + 1}/{args.repeats}: in-process {local[-1]:.1f} ms, "
                      f"http {remote[-1]:.1f} ms", file=sys.stderr, flush=True)
    local_ms, http_ms = statistics.median(local), statistics.median(remote)
    overhead = http_ms - local_ms
    target = max(5.0, 0.05 * local_ms)
    print(json.dumps({
        "model": info.name, "size": f"{info.default_width}x{info.default_height}", "steps": steps,
        "threads": args.threads, "repeats": args.repeats, "inprocess_median_ms": round(local_ms, 2),
        "http_median_ms": round(http_ms, 2), "overhead_ms": round(overhead, 2),
        "overhead_pct": round(100 * overhead / local_ms, 2),
        "paired_overhead_ms": round(statistics.median(h - l for h, l in zip(remote, local)), 2),
        "target_ms": round(target, 2),
        "within_target": overhead <= target,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
