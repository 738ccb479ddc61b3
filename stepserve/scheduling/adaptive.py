"""Cost-aware continuous batching: requests join and leave at any step, and each step runs as many of them as the
cost curve says is worth it.

Continuous batching assumes that one more request in a step is nearly free. That holds for a small model or small
images on a GPU, and fails for a DiT at 1024x1024, where a batch of n costs about n steps of one: there, sharing
every step among all the requests slows each of them down as much as it serves the others, and serving one
request at a time finishes each sooner (processor sharing loses to first come first served on equal throughput).
So each step, for the bucket it runs:

- Candidates. The bucket's slot holders and the waiting requests that free slots admit (slots: at most
  max_batch_size requests are resident over all buckets, as in continuous batching), oldest first.
- Cap (costs/online.py: OnlineStepCurve.efficient_batch). When a batch of all the candidates gets less than
  `min_gain` more throughput (requests stepped per second) than a batch of one, 1: batching buys almost nothing
  there and only slows every batch-mate down. Otherwise the smallest batch within `tolerance` of the best
  throughput up to the number of candidates. It comes out at max_batch_size when batching is cheap and at 1
  when a batch of n costs about n steps of one; in between, where it pays. While requests of the bucket wait
  for a slot, any gain above 1% pays (throughput is then what shortens their wait). The decision changes only
  when the steps show with confidence that it is wrong (hysteresis), so noisy steps do not flip it; it starts
  at one at a time, so batching must first be shown to pay (a profile's small gain within its own noise is not
  enough: an engine that starts saturated would otherwise run full batches that no step of another size ever
  questions).
- Present work. Where that says one at a time, the cap is the one that minimises the candidates' total latency
  (least_total_latency: their remaining steps replayed on the curve, its batching gain taken at the least the
  fit allows): a short request behind a long one shares its steps (it finishes far sooner, the long one later
  by only the short one's work), requests behind shorter or equal ones wait their turn. Simulated over ten
  traces each of the tiny Flux and gpu-1024 regimes, the default met the regime matrix's margins in 114 of 120
  cells with it and 99 without (docs/BENCHMARKS.md, "Present work").
- Preemption at step boundaries. The first `cap` candidates (oldest first) run; a slot holder beyond the cap
  pauses for this step: its latents and sampler state stay on the request, nothing is recomputed, and its image
  does not change. Oldest first means no request starves.
- The curve. A prior (the latency model the engine was given, e.g. measured at start-up) corrected online by the
  step times the executor reports (`observe`, called by the engine after every step), so a curve that drifts is
  followed within a few dozen steps. Every `probe_every` steps the cap is raised by one when there is a request
  to spare, so that a regime that became cheaper is seen too. While it batches all of them and the steps have
  not settled whether that pays, every fifth of that a step of one runs: saturated, every step is a full batch
  and shows nothing of the slope, so a prior that wrongly says batching pays would otherwise stand (live, the
  tiny Flux on a slower CPU ran full batches at 0.6x the throughput of one at a time; the steps at one and at a
  full batch, each size judged by its own noise, overturn it: costs/online.py, size_gain_bounds). While the
  curve is unknown (no prior, and every step seen was of one size) the policy runs every candidate, as
  continuous batching does, and one fewer every `probe_every` steps (which shows what a request adds).
- Buckets are taken in turn, least recently run first, as in continuous batching.

The policy is pure: no torch, no clock; the simulator runs it unchanged.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..costs.latency_model import Bucket, LatencyModel
from ..costs.online import CONFIDENCE, DEFAULT_HALF_LIFE_STEPS, OnlineStepCurve
from ..request.types import Request, RequestStatus, StepPlan
from .continuous import ContinuousBatchingPolicy

DEFAULT_TOLERANCE = 0.01  # a batch within 1% of the best throughput is as good as the best
DEFAULT_MIN_GAIN = 0.10  # batching that gains less than 10% throughput is not worth slowing batch-mates down
DEFAULT_PROBE_EVERY = 50
# while requests wait for a slot, throughput is what shortens their wait: any batching gain above this counts
BACKLOG_MIN_GAIN = 0.01


class AdaptiveBatchingPolicy(ContinuousBatchingPolicy):
    name = "adaptive"

    def __init__(self, max_batch_size: int, latency_model: LatencyModel | None = None,
                 tolerance: float = DEFAULT_TOLERANCE, min_gain: float = DEFAULT_MIN_GAIN,
                 probe_every: int = DEFAULT_PROBE_EVERY,
                 half_life_steps: float = DEFAULT_HALF_LIFE_STEPS) -> None:
        super().__init__(max_batch_size)
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1 step, got {probe_every}")
        prior = latency_model if latency_model is not None and latency_model.metadata.get("source") != "zero" \
            else None
        self.tolerance = tolerance
        self.min_gain = min_gain
        self.probe_every = probe_every
        self.curve = OnlineStepCurve(prior, max_batch_size, half_life_steps)
        self.cap: dict[Bucket, int] = {}  # the cap in force per bucket (for logs and /metrics)

    def observe(self, bucket: Bucket, batch_size: int, seconds: float) -> None:
        """A denoising step of `batch_size` requests of `bucket` took `seconds` (the executor's own measure)."""
        self.curve.observe(bucket, batch_size, seconds)

    def step_plan(self, bucket: Bucket, holders: list[Request], joining: list[Request],
                  queued: int = 0) -> StepPlan:
        candidates = sorted(holders + joining, key=lambda r: r.arrival_time)  # oldest first
        cap = cost_aware_cap(self.curve, bucket, [r.num_inference_steps - r.step for r in candidates],
                             self._turns.steps, self.tolerance, self.min_gain, self.probe_every, queued)
        self.cap[bucket] = cap
        batch = candidates[:cap]
        return StepPlan(admit=[r for r in batch if r.status is RequestStatus.WAITING], run=batch)


def cost_aware_cap(curve: OnlineStepCurve, bucket: Bucket, remaining: Sequence[int], steps: int,
                   tolerance: float = DEFAULT_TOLERANCE, min_gain: float = DEFAULT_MIN_GAIN,
                   probe_every: int = DEFAULT_PROBE_EVERY, queued: int = 0) -> int:
    """How many of the candidates (`remaining`: the steps each has left, in service order) to run in step number
    `steps`: what the curve says pays for throughput; where that is one, as many as lower the candidates' own
    total latency (least_total_latency); and one more every `probe_every` steps when there is one to spare, so
    that a curve that became cheaper is seen too. While the curve is unknown (every step seen so far was of one
    size), all of them, and one fewer every `probe_every` steps, so that the slope can be seen.

    `queued`: requests of the bucket still waiting for a slot. While there are any, the work in hand exceeds what
    the slots hold, and a request's wait is set by how fast the engine drains the queue: then any throughput
    gain above BACKLOG_MIN_GAIN makes batching pay (instead of `min_gain`, which weighs the gain against the
    batch-mates' slowdown when nobody is waiting). Near a one-at-a-time server's capacity, a few percent more
    throughput is most of the queueing delay (simulated, a tiny Flux on this CPU whose batches gain 3-5%, at 0.9
    of capacity: p95 12.6 s against 16.9 s one at a time)."""
    available = len(remaining)
    if available <= 1:  # nothing to decide (efficient_batch's answer, before any fit is read)
        return max(available, 0)
    if queued > 0:
        min_gain = min(min_gain, BACKLOG_MIN_GAIN)
    fit = curve.fit(bucket)  # once per step: the decision, the present work and the probe read it
    cap = curve.decide(bucket, available, tolerance, min_gain, fit=fit)  # all of them while the curve is unknown
    if cap == 1 and available > 1:
        costs = curve.step_costs(bucket, available, CONFIDENCE, fit=fit)  # batching's gain at its least
        if costs is not None:
            cap = least_total_latency(costs, remaining)
    if (cap == available and fit is not None and steps % max(probe_every // 5, 1) == 0
            and curve.gain_unsettled(bucket, available, min_gain, fit)):
        # batching all of them while the steps at one and at this many have not settled whether it pays (under
        # saturation every step is a full batch, and nothing but the prior shows the slope): a step of one
        return 1
    if steps % probe_every:
        return cap
    if fit is None:  # the curve unknown: one fewer, so that the slope can be seen
        return available - 1
    return cap + 1 if cap < available else cap


def least_total_latency(step_costs: Sequence[float], remaining: Sequence[int]) -> int:
    """The batch cap k that minimises the sum of the finish times of requests with `remaining` steps each, served
    in the given order at most k at a time (a slot that frees goes to the next), a step of b costing
    step_costs[b - 1].

    The marginal cost of one more row against the wait it saves: where a batch of n costs about n steps of one,
    a request behind a longer one finishes far sooner sharing its steps (4 steps behind 15: 8 step-costs instead
    of 19) while the long one loses only the short one's work, so the total falls; behind a shorter one, or an
    equal one, it rises, and one at a time (first come first served) stays. The smallest such k on ties. Encodes
    and decodes are left out (they are the same whatever k)."""
    best_k, best = 1, math.inf
    for k in range(1, len(remaining) + 1):
        total = _total_finish(step_costs, remaining, k)
        if total < best * (1 - 1e-9):
            best_k, best = k, total
    return best_k


def _total_finish(step_costs: Sequence[float], remaining: Sequence[int], k: int) -> float:
    """Sum of the finish times in least_total_latency's replay (event to event, as predict.py's)."""
    slots: list[int] = []  # heap: global step count at which each running request is done
    done = nxt = 0
    t = total = 0.0
    while slots or nxt < len(remaining):
        while len(slots) < k and nxt < len(remaining):
            heapq.heappush(slots, done + max(remaining[nxt], 1))
            nxt += 1
        until = slots[0]
        t += (until - done) * step_costs[len(slots) - 1]
        done = until
        while slots and slots[0] == until:
            heapq.heappop(slots)
            total += t
    return total
