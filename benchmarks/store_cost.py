"""What the state store costs per operation, for each backend: create, claim, update (a running job's progress
write) and get.

    python benchmarks/store_cost.py [--jobs 200] [--repeats 5] [--redis URL] [--step-ms 12,1000]

Each repeat creates --jobs jobs in a fresh store, claims each, writes one owner-fenced progress update per job (what
a running job writes after a step) and reads each back. Prints the median over the repeats of each operation's mean
time, its ratio to the memory store's, and what one progress write is against a step of each --step-ms (default:
12 ms, a step of the embedded model alone; 1000 ms, a video step). SQLite runs on a file in a temporary folder;
Redis on --redis URL, else on a redis-server started for the run (loopback, no persistence), else it is left out.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from stepserve.store import JobRecord
from stepserve.store.memory import MemoryStore
from stepserve.store.sqlite import SqliteStore

OPERATIONS = ("create", "claim", "update", "get")


def one_repeat(store, jobs: int) -> dict[str, float]:
    """Mean seconds per operation over `jobs` jobs; the jobs are deleted afterwards."""
    tag = uuid.uuid4().hex[:8]
    ids = [f"bench-{tag}-{i}" for i in range(jobs)]
    request = {"prompt": "a lighthouse at dusk", "seed": 7, "num_inference_steps": 30, "size": "832x480"}
    times = {}
    start = time.perf_counter()
    for i, job_id in enumerate(ids):
        store.create_job(JobRecord(id=job_id, kind="video", request=request, created_at=store.now() + i * 1e-6))
    times["create"] = time.perf_counter() - start
    start = time.perf_counter()
    for _ in ids:
        store.claim_job("bench", lease_s=600)
    times["claim"] = time.perf_counter() - start
    start = time.perf_counter()
    for i, job_id in enumerate(ids):
        store.update_job(job_id, owner="bench", progress=i % 100, lease_until=store.now() + 600)
    times["update"] = time.perf_counter() - start
    start = time.perf_counter()
    for job_id in ids:
        store.get_job(job_id)
    times["get"] = time.perf_counter() - start
    for job_id in ids:
        store.delete_job(job_id)
    return {op: seconds / jobs for op, seconds in times.items()}


def measure(open_store, jobs: int, repeats: int) -> dict[str, float]:
    runs = []
    for _ in range(repeats):
        store = open_store()
        runs.append(one_repeat(store, jobs))
        store.close()
    return {op: statistics.median(run[op] for run in runs) for op in OPERATIONS}


def redis_opener(url: str | None, stack: ExitStack):
    """How to open a Redis store, or None (with the reason printed) when there is none to use."""
    try:
        from stepserve.store.redis import RedisStore
    except ImportError:
        print("redis: left out (the redis package is missing: pip install 'stepserve[redis]')")
        return None
    if url is None:
        if shutil.which("redis-server") is None:
            print("redis: left out (no --redis URL and no redis-server on PATH)")
            return None
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "store"))
        from redis_server import running_redis

        url = stack.enter_context(running_redis(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
    prefix = f"stepserve-bench-{uuid.uuid4().hex[:8]}:"  # apart from anything else the server holds
    return lambda: RedisStore(url, prefix=prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=200, help="jobs per repeat")
    ap.add_argument("--repeats", type=int, default=5, help="repeats; each operation's median is printed")
    ap.add_argument("--redis", metavar="URL", help="a Redis to measure (default: start a redis-server)")
    ap.add_argument("--step-ms", default="12,1000", help="step times to compare a progress write with")
    args = ap.parse_args()
    steps_ms = [float(s) for s in args.step_ms.split(",")]
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        openers = {"memory": MemoryStore, "sqlite": lambda: SqliteStore(folder / f"{uuid.uuid4().hex}.db")}
        if (redis := redis_opener(args.redis, stack)) is not None:
            openers["redis"] = redis
        costs = {name: measure(opener, args.jobs, args.repeats) for name, opener in openers.items()}
    print(f"\nper operation, median of {args.repeats} repeats of {args.jobs} jobs (x: times the memory store's)")
    print(f"{'backend':8}" + "".join(f"{op:>22}" for op in OPERATIONS))
    for name, cost in costs.items():
        cells = "".join(f"{cost[op] * 1e6:10.1f} us {cost[op] / costs['memory'][op]:7.0f}x" for op in OPERATIONS)
        print(f"{name:8}{cells}")
    print("\none progress write against one step:")
    for name, cost in costs.items():
        shares = ", ".join(f"{cost['update'] * 1000 / ms:.3%} of a {ms:g} ms step" for ms in steps_ms)
        print(f"{name:8}{shares}")


if __name__ == "__main__":
    main()
