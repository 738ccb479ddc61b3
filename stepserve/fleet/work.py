"""Predicted seconds of work in hand: what a replica still has to do, from its requests and its cost model.

ONE function (`work_s`) turns a replica's requests into seconds, and everything that needs the number calls it:
the engine core keeps a `Tally` of its requests (updated in O(1) as they arrive, step and end), the live replica
publishes `work_s(core.tally, ...)` to the routers and the autoscaler, and the simulator's replicas are the same
EngineCore with the same tally.

The prediction, per shape bucket with `held` requests, `steps` remaining denoising steps between them and `fresh`
requests not yet started (their prompts still to encode), at the batch size they will run at, b = min(held,
max_batch):

    seconds = steps * step_s(b) / b  +  held * decode_s(b) / b  +  fresh * encode_s(b) / b

that is every remaining request-step at the cost of one row of a batch of b, plus each request's share of a
batched decode (and encode). Buckets do not share a forward, so their seconds add up. It is a fluid estimate:
a queue drains at the full batch and the last few requests run at smaller ones, which costs a little more than
this where batching is cheap (and the same where a batch of n costs n forwards). Requests with a video bucket
(frames, height, width) are priced the same way: a background video job is work in hand like any other.

Pure data and arithmetic: no clock, no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..costs.latency_model import LatencyModel
from ..request.buckets import Bucket

HELD, STEPS, FRESH = 0, 1, 2  # the fields of a bucket's load: [held, steps, fresh]


def bucket_s(held: int, steps: int, fresh: int, bucket: Bucket, latency: LatencyModel, max_batch: int) -> float:
    """Predicted seconds to finish `held` requests of `bucket` with `steps` denoising steps left between them,
    `fresh` of which have not started (module docstring)."""
    if held <= 0:
        return 0.0
    b = min(held, max_batch)
    return (steps * latency.step_s(b, bucket) + held * latency.decode_s(b, bucket) + fresh * latency.encode_s(b)) / b


def work_s(loads: Mapping[Bucket, list[int]] | Tally, latency: LatencyModel, max_batch: int) -> float:
    """Predicted seconds of work in hand: the sum over buckets of bucket_s. `loads` maps a bucket to [held,
    steps, fresh] (a Tally's `loads`, or a Tally)."""
    if isinstance(loads, Tally):
        loads = loads.snapshot()
    return sum(bucket_s(v[HELD], v[STEPS], v[FRESH], b, latency, max_batch) for b, v in loads.items())


def remaining_steps(r) -> int:
    """Denoising steps a request still has to take (0 once it only waits for its decode)."""
    return max(r.num_inference_steps - r.step, 0)


class Tally:
    """Per shape bucket, the requests an engine holds: [held, remaining steps, not yet started]. Kept by the
    engine core as requests are queued (`add`), admitted into a batch (`started`), take steps (`advanced`) and
    end (`remove`); each costs O(1). `version` grows with every change, so a reader can tell a stale copy."""

    __slots__ = ("loads", "version")

    def __init__(self, requests: Iterable = ()) -> None:
        self.loads: dict[Bucket, list[int]] = {}
        self.version = 0
        for r in requests:
            self.add(r)

    def add(self, r) -> None:
        """A request joins (waiting, or already running when it is not WAITING)."""
        v = self.loads.get(r.bucket)
        if v is None:
            v = self.loads[r.bucket] = [0, 0, 0]
        v[HELD] += 1
        v[STEPS] += remaining_steps(r)
        v[FRESH] += _fresh(r)
        self.version += 1

    def started(self, r) -> None:
        """A waiting request was admitted into the running set (its prompt is encoded now)."""
        self.loads[r.bucket][FRESH] -= 1
        self.version += 1

    def advanced(self, bucket: Bucket, rows: int) -> None:
        """`rows` requests of `bucket` each took one denoising step."""
        self.loads[bucket][STEPS] -= rows
        self.version += 1

    def remove(self, r) -> None:
        """A request ended (any way); call it before its status changes, so a waiting one is known as such."""
        v = self.loads[r.bucket]
        v[HELD] -= 1
        v[STEPS] -= remaining_steps(r)
        v[FRESH] -= _fresh(r)
        if v[HELD] <= 0:
            del self.loads[r.bucket]
        self.version += 1

    def snapshot(self) -> dict[Bucket, list[int]]:
        """A copy that another thread may read while the engine goes on (one C-level copy under the GIL)."""
        return {b: list(v) for b, v in list(self.loads.items())}

    @property
    def held(self) -> int:
        return sum(v[HELD] for v in list(self.loads.values()))

    def __repr__(self) -> str:
        return f"Tally({self.snapshot()})"


def _fresh(r) -> int:
    return 1 if getattr(r.status, "name", "") == "WAITING" else 0
