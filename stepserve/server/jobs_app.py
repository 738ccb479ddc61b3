"""The jobs of one app (stepserve/jobs/ over the server's kinds): the store and results folder it was given (by
default a temporary folder of its own, removed with the app: a test, or `--state memory`), the kinds this model
makes (async images; videos on a video model), how many jobs this process runs at once
(ServerLimits.max_running_jobs, by default the engine's max_batch_size), its owner id in the store, the service
its jobs (and adapter registrations) belong to, and where webhooks may go (public addresses, and the internal
receivers `webhook_allow` names: serve --webhook-allow).

The default service is derived from what the server serves: the model's name and family and a short hash of
everything in its ModelInfo that changes which requests it can run (sizes, samplers, video, ControlNets,
IP-Adapters, image to image, ...; not the LoRA adapters loaded now nor the names in its add-on folders, which
change while it serves and between its replicas' starts). So two servers
of different models, or of one model with different add-ons, never run each other's jobs, while replicas of one
deployment (the same model and flags) share theirs; `serve --service NAME` names one deliberately."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import socket

from ..jobs.notify import payloads
from ..jobs.service import DEFAULT_MAX_ATTEMPTS, Jobs
from ..jobs.targets import WebhookTargets
from ..jobs.webhooks import WebhookSender
from ..store.base import Store
from ..store.results import Results
from .image_jobs import ImageKind
from .state import ServerState
from .video_jobs import VideoKind


# ModelInfo fields that change while a server runs or between its replicas' starts (the adapters loaded now, the
# add-on folders' listings: a ControlNet copied in before one replica starts): not part of its service, so that
# replicas keep sharing their jobs and a restart finds its queued ones; whether it serves ControlNets or IP-Adapters
# at all (a folder given) is, so a server without them never takes a job that names one
RUNTIME_FIELDS = ("lora_names", "control_guess_only")
SERVED_ONLY = ("control_names", "ip_adapter_names")  # counted only as whether any is served (a folder given)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_service(info) -> str:
    """NAME-FAMILY-HASH8 of a ModelInfo (see the module docstring); a valid service name (store/base.py)."""
    served = {f.name: bool(getattr(info, f.name)) if f.name in SERVED_ONLY else getattr(info, f.name)
              for f in dataclasses.fields(info) if f.name not in RUNTIME_FIELDS}
    text = json.dumps(served, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else
                      repr(v))
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    prefix = _UNSAFE.sub("-", f"{info.name}-{info.family}").strip("-._")[:80] or "model"
    return f"{prefix}-{digest}"


def attach_jobs(state: ServerState, store: Store, results: Results | None = None, owner: str | None = None,
                webhook_secret: str | None = None, lease_s: float = 30.0, poll_s: float = 1.0,
                service: str | None = None, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
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
    service = service or default_service(engine.model_info)
    state.jobs = Jobs(engine, store, results, owner or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}",
                      kinds, service=service,
                      max_running=state.limits.max_running_jobs or engine.options.max_batch_size,
                      lease_s=lease_s, poll_s=poll_s, max_attempts=max_attempts,
                      sender=WebhookSender(store, webhook_secret, lease_s=lease_s, targets=targets,
                                           payload_of=payloads(kinds), service=service),
                      webhook_secret=webhook_secret, on_close=lambda: [close() for close in closers])
    return state.jobs
