"""What the state store costs the default single-server path: images/s at saturation through HTTP with the SQLite
store on (`stepserve serve`'s default) vs the memory store, same model and settings.

Each round starts a server (uvicorn + the app over an AsyncEngine, in a background thread, as http_overhead.py)
on a fresh store, warms it up, then sends --requests synchronous image requests, --concurrency at a time (closed
loop: enough to keep every batch full), and measures completed images per second. Rounds alternate (memory,
sqlite, memory, ...) so that load drifting on a shared machine hits both alike; each side's figure is the median of
its --rounds. Synchronous requests never call the store; what the SQLite store adds is the background work of a
server with jobs and adapters on it (the job runner's claim poll, the adapter registry's sync, the sweep), so the
time spent inside store calls during the measured load is reported too, as a share of the round's wall time: a
figure that the machine's noise does not move the way it moves images/s on a shared CPU. The last line printed is a
JSON summary with the ratio sqlite / memory.

    python3 benchmarks/store_overhead.py [--model auto|embedded|PATH] [--rounds 5] [--requests 96] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import pick_model
from http_overhead import Server


class Timed:
    """A store (wrapping another) that adds up the time spent in its calls."""

    def __init__(self, store) -> None:
        self._store, self.url, self.seconds, self.calls = store, store.url, 0.0, 0

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def one_round(executor, kind: str, folder: Path, args) -> tuple[float, float, int]:
    """(images/s, the share of the measured wall time spent in store calls, those calls)."""
    import httpx

    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.server.app import create_app
    from stepserve.store.memory import MemoryStore
    from stepserve.store.results import Results
    from stepserve.store.sqlite import SqliteStore

    store = Timed(MemoryStore() if kind == "memory" else SqliteStore(folder / f"state-{time.monotonic_ns()}.db"))
    results = Results(folder / "results", keep_s=3600)
    app = create_app(AsyncEngine(executor, strategy="continuous", max_batch_size=args.max_batch_size), store=store,
                     results=results, access_log=False)
    body = {"prompt": "a handwritten 7", "num_inference_steps": args.steps}

    async def load(url: str, n: int) -> float:
        gate = asyncio.Semaphore(args.concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            async def one(i: int) -> None:
                async with gate:
                    answer = await client.post("/v1/images/generations", json={**body, "seed": i})
                    assert answer.status_code == 200, answer.text

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            return time.perf_counter() - start

    try:
        with Server(app) as server:
            asyncio.run(load(server.url, args.concurrency))  # warm-up, not measured
            before, calls = store.seconds, store.calls
            wall = asyncio.run(load(server.url, args.requests))
            return args.requests / wall, (store.seconds - before) / wall, store.calls - calls
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="auto", help="auto (embedded if installed, else a tiny random SD), "
                                                    "embedded, or a diffusers folder")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each side (alternating)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on shared CPUs)")
    args = ap.parse_args(argv)

    import torch

    from stepserve.engine.loading import load_executor

    torch.set_num_threads(args.threads)
    executor = load_executor(pick_model(args.model))
    rates: dict[str, list[float]] = {"memory": [], "sqlite": []}
    shares: dict[str, list[float]] = {"memory": [], "sqlite": []}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.rounds):
            for kind in ("memory", "sqlite") if i % 2 == 0 else ("sqlite", "memory"):
                rate, share, calls = one_round(executor, kind, Path(folder), args)
                rates[kind].append(rate)
                shares[kind].append(share)
                print(f"round {i + 1}/{args.rounds} {kind}: {rate:.2f} images/s; {calls} store calls, "
                      f"{100 * share:.3f}% of the time", file=sys.stderr, flush=True)
    memory, sqlite = statistics.median(rates["memory"]), statistics.median(rates["sqlite"])
    print(json.dumps({
        "model": executor.model_info.name, "steps": args.steps, "threads": args.threads,
        "max_batch_size": args.max_batch_size, "requests": args.requests, "concurrency": args.concurrency,
        "rounds": args.rounds, "memory_images_per_s": round(memory, 3), "sqlite_images_per_s": round(sqlite, 3),
        "ratio_sqlite_over_memory": round(sqlite / memory, 4),
        "rounds_memory": [round(r, 3) for r in rates["memory"]], "rounds_sqlite": [round(r, 3) for r in rates["sqlite"]],
        "within_2_percent": sqlite >= 0.98 * memory,
        "store_time_share_sqlite": round(statistics.median(shares["sqlite"]), 6),
        "store_time_share_memory": round(statistics.median(shares["memory"]), 6),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
