"""Prometheus metrics for one app: its own CollectorRegistry, so two servers in one process never share counters.

Engine-side numbers (step latency, batch size) come from the engine's on_step callback, which runs in the engine
thread; prometheus_client's metric types are thread-safe. Queue depth and running requests are read on scrape.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..request.buckets import bucket_name
from ..request.types import FinishReason, StepReport

CONTENT_TYPE = CONTENT_TYPE_LATEST
log = logging.getLogger(__name__)

OUTCOMES = ("completed", "invalid", "unauthorized", "rejected", "shutting_down", "timeout", "failed", "cancelled")
UNAUTHORIZED_ROUTES = ("metrics", "models", "openapi", "loras", "videos", "jobs", "events")
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_VIDEO_BUCKETS = _REQUEST_BUCKETS + (600.0, 1200.0, 1800.0, 3600.0)  # a video job may take many minutes


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_depth = Gauge("stepserve_queue_depth", "Requests waiting for a slot in the engine", registry=r)
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.running = Gauge("stepserve_running_requests", "Requests admitted and not finished", registry=r)
        self.running.set_function(lambda: engine.running_count)
        self.last_batch_size = 0
        self.batch_size = Gauge("stepserve_running_batch_size",
                                "Requests in the latest denoising forward pass (0 when nothing runs)", registry=r)
        self.batch_size.set_function(lambda: self.last_batch_size if engine.running_count else 0)
        self.step_latency = Histogram("stepserve_step_latency_seconds",
                                      "Duration of one engine step (encode + denoise + decode)",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.step_batch = Histogram("stepserve_step_batch_size", "Batch size of each denoising forward pass",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.request_latency = Histogram("stepserve_request_latency_seconds",
                                         "HTTP image requests, arrival to answer, by outcome", ["outcome"],
                                         buckets=_REQUEST_BUCKETS, registry=r)
        self.requests = Counter("stepserve_requests", "HTTP image requests by outcome", ["outcome"], registry=r)
        self.rejected = Counter("stepserve_rejected", "Requests refused because the queue was full (429)",
                                registry=r)
        self.cancelled = Counter("stepserve_cancelled", "Requests cancelled because the client went away",
                                 registry=r)
        self.failed = Counter("stepserve_failed", "Requests that failed in the model (500; a video request also "
                              "when this server has no video encoder, 501)", registry=r)
        self.timed_out = Counter("stepserve_timed_out", "Requests past their timeout_s (504)", registry=r)
        self.refused_at_admission = Counter(
            "stepserve_refused_at_admission", "Requests refused at arrival (429): the queue was full, or the "
            "policy predicted a missed deadline", ["reason"], registry=r)
        self.deadline_missed = Counter(
            "stepserve_deadline_missed", "Admitted requests that ended past or hopeless for their deadline (504), by "
            "whether they were still queued or had started running", ["stage"], registry=r)
        self.unauthorized = Counter(
            "stepserve_unauthorized_calls", "Calls refused for a missing or wrong API key (401) on routes other than "
            "image generation (those count in stepserve_requests{outcome=\"unauthorized\"})", ["route"], registry=r)
        for route in UNAUTHORIZED_ROUTES:
            self.unauthorized.labels(route)
        self.images = Counter("stepserve_images_completed", "Images generated and returned", registry=r)
        self.video_jobs = Counter("stepserve_video_jobs", "POST /v1/videos by outcome: refused at once (invalid, "
                                  "unauthorized, rejected, shutting_down; failed: 501, no video encoder here), or how "
                                  "the job it created ended",
                                  ["outcome"], registry=r)
        self.video_latency = Histogram("stepserve_video_job_seconds", "POST /v1/videos, arrival to the job's end "
                                       "(MP4 made, or failed), by outcome", ["outcome"], buckets=_VIDEO_BUCKETS,
                                       registry=r)
        self.policy = getattr(getattr(engine, "core", None), "policy", None)
        self.batch_cap = Gauge("stepserve_batch_cap", "Requests one step may run, per shape bucket (WxH): the cap the "
                               "cost-aware policy (adaptive) derives from its step curve", ["bucket"], registry=r)
        self.step_curve = Gauge("stepserve_step_curve_seconds", "The adaptive policy's step curve per shape bucket: "
                                "part=fixed (a step of any size) and part=per_request (one more request)",
                                ["bucket", "part"], registry=r)
        self.profile_scale = Gauge("stepserve_profile_scale", "Observed over profiled step time per shape bucket: "
                                   "what the slo policy multiplies its latency model's predictions by (admission, "
                                   "give-up, the deadline cap)", ["bucket"], registry=r)
        self._caps: dict = {}
        for reason in ("queue_full", "deadline"):
            self.refused_at_admission.labels(reason)
        for stage in ("queued", "running"):
            self.deadline_missed.labels(stage)
        for outcome in OUTCOMES:  # export zeros from the start, so rates work before the first event
            self.requests.labels(outcome)
            self.request_latency.labels(outcome)
            self.video_jobs.labels(outcome)
            self.video_latency.labels(outcome)

    def on_step(self, report: StepReport) -> None:
        """Engine-thread callback, once per engine step."""
        if report.batch_size:
            self.step_latency.observe(report.duration_s)
            self.step_batch.observe(report.batch_size)
        self.last_batch_size = report.batch_size
        for r in report.finished:
            if r.finish_reason is FinishReason.TIMEOUT:
                self.deadline_missed.labels("queued" if r.timing.admitted is None else "running").inc()
        caps = getattr(self.policy, "cap", None)
        if caps:
            self._show_curve(caps)

    def _show_curve(self, caps: dict) -> None:
        """The cost-aware policy's batch bound and step curve, on /metrics and, when the bound changes, in the log.
        The bound is what the curve allows with max_batch_size requests at hand (the cap of a step is also
        limited by the requests there are, which says nothing about the curve)."""
        from ..scheduling.adaptive import DEFAULT_MIN_GAIN, DEFAULT_TOLERANCE

        drift = getattr(getattr(self.policy, "latency_model", None), "factor", None)  # slo's correction
        for bucket in caps:
            name = bucket_name(bucket)
            if drift is not None:
                self.profile_scale.labels(name).set(drift(bucket))
            curve = self.policy.curve
            fit = curve.fit(bucket)  # fitted once per step here, and reused for the bound
            line = None if fit is None else fit.line()
            cap = curve.efficient_batch(bucket, self.policy.max_batch_size,
                                        getattr(self.policy, "tolerance", DEFAULT_TOLERANCE),
                                        getattr(self.policy, "min_gain", DEFAULT_MIN_GAIN), fit=fit,
                                        batching=curve.batching.get(bucket))
            self.batch_cap.labels(name).set(cap)
            if line is not None:
                self.step_curve.labels(name, "fixed").set(line[0])
                self.step_curve.labels(name, "per_request").set(line[1])
            if self._caps.get(bucket) != cap:
                self._caps[bucket] = cap
                shown = ("unknown yet" if line is None
                         else f"{line[0] * 1000:.1f} ms + {line[1] * 1000:.1f} ms per request")
                log.info("batch bound for %s: at most %d per step (step curve %s)", name, cap, shown)

    def request_done(self, outcome: str, seconds: float, images: int = 0) -> None:
        self.requests.labels(outcome).inc()
        self.request_latency.labels(outcome).observe(seconds)
        self._count(outcome)
        if images:
            self.images.inc(images)

    def video_done(self, outcome: str, seconds: float) -> None:
        self.video_jobs.labels(outcome).inc()
        self.video_latency.labels(outcome).observe(seconds)
        self._count(outcome)

    def _count(self, outcome: str) -> None:
        """The counters every request feeds, images and videos alike (every 429 sent is in `rejected`)."""
        counter = {"rejected": self.rejected, "cancelled": self.cancelled, "failed": self.failed,
                   "timeout": self.timed_out}.get(outcome)
        if counter is not None:
            counter.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
