"""The jobs of one app (stepserve/jobs/ over the server's kinds): the store and results folder it was given (by
default a temporary folder of its own, removed with the app: a test, or `--state memory`), the kinds this model makes (async images; videos on a video model), how many jobs this process runs at
once (ServerLimits.max_running_jobs, by default the engine's max_batch_size) and its owner id in the store; where
webhooks may go (public addresses, and the internal receivers `webhook_allow` names: serve --webhook-allow)."""

from __future__ import annotations

import os
import secrets
import socket

from ..jobs.service import Jobs
from ..jobs.notify import payloads
from ..jobs.targets import WebhookTargets
from ..jobs.webhooks import WebhookSender
from ..store.base import Store
from ..store.results import Results
from .image_jobs import ImageKind
from .state import ServerState
from .video_jobs import VideoKind


def attach_jobs(state: ServerState, store: Store, results: Results | None = None, owner: str | None = None,
                webhook_secret: str | None = None, lease_s: float = 30.0, poll_s: float = 1.0,
                webhook_allow: tuple[str, ...] | list[str] = ()) -> Jobs:
    state.webhook_targets = targets = WebhookTargets.allowing(webhook_allow)  # ValueError for a malformed entry
    closers = []
    if results is None:
        results = Results.in_temporary_folder()
        closers.append(results.close)
    engine = state.engine
    kinds = {"image": ImageKind(state)}
    if engine.model_info.video:
        kinds["video"] = VideoKind(state)
    state.jobs = Jobs(engine, store, results, owner or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}",
                      kinds, max_running=state.limits.max_running_jobs or engine.options.max_batch_size,
                      lease_s=lease_s, poll_s=poll_s,
                      sender=WebhookSender(store, webhook_secret, lease_s=lease_s, targets=targets,
                                           payload_of=payloads(kinds)),
                      webhook_secret=webhook_secret, on_close=lambda: [close() for close in closers])
    return state.jobs
