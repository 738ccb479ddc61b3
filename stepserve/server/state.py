"""The state one server app holds (ServerState, on app.state): the engine, limits, metrics, the API key, the
requests in flight, draining, and where every image and video request is recorded once (metrics and the access log).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.async_engine import AsyncEngine
from .metrics import ServerMetrics
from .schemas import ServerLimits

access = logging.getLogger("stepserve.access")
GENERATIONS, VIDEOS = "/v1/images/generations", "/v1/videos"
CLIENT_GONE = 499  # never read by anyone: the client has disconnected


@dataclass
class ServerState:
    """The state one app holds (plain data on app.state, no module globals) and its Retry-After estimate."""

    engine: AsyncEngine
    limits: ServerLimits
    metrics: ServerMetrics
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()  # web origins whose pages may call the API (--cors-origin)
    started_at: int = field(default_factory=lambda: int(time.time()))
    inflight: int = 0  # HTTP image requests being served (streams included)
    draining: bool = False
    recent_request_s: float = 1.0  # smoothed engine time per request, for Retry-After
    access_log: bool = True  # one INFO line per image or video request on the "stepserve.access" logger
    events: Any = None  # the engine's steps for the console (server/events.py), ended when draining starts
    jobs: Any = None  # the jobs of this app (server/jobs_app.py: stepserve/jobs/ over the store), stopped when draining
    webhook_targets: Any = None  # where webhooks may go (jobs/targets.py: WebhookTargets), set with the jobs

    def request_done(self, outcome: str, status: int, started: float, results: Sequence[Any] = (),
                     path: str = GENERATIONS) -> None:
        """Every image request (`path`: generations or edits) ends here, once: its metrics and its access-log
        line (method, path, status, outcome, latency, and per image the steps and the batch sizes it ran in)."""
        seconds = time.monotonic() - started
        self.metrics.request_done(outcome, seconds, len(results))
        if self.access_log and access.isEnabledFor(logging.INFO):
            access.info("POST %s %d %s %.3f s%s", path, status, outcome, seconds, _images(results))

    def video_done(self, outcome: str, status: int, started: float, result: Any = None, job_id: str = "") -> None:
        """Every POST /v1/videos ends here, once: refused at once (`status` the error's), or a job that ended
        (`status` 200, the answer its creation got; `outcome` how the job ended): its metrics and its access-log
        line, as request_done's, with the job's id."""
        seconds = time.monotonic() - started
        self.metrics.video_done(outcome, seconds)
        if self.access_log and access.isEnabledFor(logging.INFO):
            details = f" id={job_id}" if job_id else ""
            if result is not None:
                details += f" frames={result.params.num_frames}" + _images([result])
            access.info("POST %s %d %s %.3f s%s", VIDEOS, status, outcome, seconds, details)

    def note_latency(self, seconds: float) -> None:
        self.recent_request_s = 0.8 * self.recent_request_s + 0.2 * seconds

    def retry_after_s(self) -> int:
        """Whole seconds until a place is likely to free up: the batches queued ahead times a recent request's
        time, between 1 and 60."""
        batches_ahead = self.engine.queue_depth / max(1, self.engine.options.max_batch_size) + 1
        return int(min(60, max(1, math.ceil(batches_ahead * self.recent_request_s))))


def _images(results: Sequence[Any]) -> str:
    """' n=2 steps=20 batch=1-4' for the access log: the images' steps and the smallest and largest batch each
    of their steps ran in (empty for a request that produced none)."""
    if not results:
        return ""
    steps = sorted({r.params.num_inference_steps for r in results})
    sizes = [b for r in results for b in (r.timing.batch_sizes or [])]
    batch = f" batch={min(sizes)}-{max(sizes)}" if sizes else ""
    return f" n={len(results)} steps={','.join(map(str, steps))}{batch}"
