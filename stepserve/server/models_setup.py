"""Building a server of several models: the ModelSet over one SharedDevice and the front over it, the same in one
process (commands/serve_models.py) and in every Ray Serve replica (ray/deployment.py), which each build their own
from the plain ModelsConfig that travels to them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..scheduling.device_share import DeviceShare
from .models import ModelSet, ModelSpec
from .startup import ServeSettings, job_options, say

MIB = 2**20


@dataclass(frozen=True)
class ModelsConfig:
    """The models a server serves and the memory they share, as plain data (pickled into each replica)."""

    specs: tuple[ModelSpec, ...]
    default: str
    device_bytes: int | None = None  # --device-memory-mb for all models together (None: unbounded)
    host_bytes: int | None = None  # --host-memory-mb for the models moved off the device (None: unbounded)

    @classmethod
    def of(cls, specs, default: str, device_memory_mb: float | None, host_memory_mb: float | None) -> ModelsConfig:
        return cls(tuple(specs), default, None if device_memory_mb is None else int(device_memory_mb * MIB),
                   None if host_memory_mb is None else int(host_memory_mb * MIB))

    def with_engines(self, **changes) -> ModelsConfig:
        """Every model's EngineConfig with `changes` (a replica's threads and memory share)."""
        return dataclasses.replace(self, specs=tuple(dataclasses.replace(s, config=dataclasses.replace(
            s.config, **changes)) for s in self.specs))


def model_set(config: ModelsConfig, settings: ServeSettings, store, results, owner: str, **app_args) -> ModelSet:
    """The models on one shared device, each with its app made by create_app with the server's settings;
    `app_args` add to or override create_app's arguments (a replica's id, its key, its webhook secret)."""
    from ..engine.device import SharedDevice
    from .app import create_app
    from .jobs_app import default_service

    specs = config.specs
    device = SharedDevice(DeviceShare({s.name: s.weight for s in specs}), config.device_bytes, config.host_bytes)
    served = [n for s in specs for n in (s.name, *s.aliases)]

    def make_app(spec, engine):
        aliases = (spec.name, *spec.aliases)
        limits = dataclasses.replace(settings.limits, served_model_names=aliases,
                                     other_models=tuple(n for n in served if n not in aliases))
        info = dataclasses.replace(engine.model_info, name=spec.name)
        service = model_service(settings.service, spec.name) if settings.service else default_service(info)
        args = dict(api_key=settings.api_key, limits=limits, shutdown_grace_s=settings.shutdown_grace_s,
                    cors_origins=settings.cors_origins, access_log=settings.access_log, store=store,
                    results=results, owner=owner, webhook_secret=settings.webhook_secret,
                    webhook_allow=settings.webhook_allow, **{**job_options(settings), "service": service})
        return create_app(engine, **{**args, **app_args})

    models = ModelSet(list(specs), config.default, device, make_app)
    models.store = store  # where a job's route finds which model the job belongs to (dispatch.py)
    return models


def model_service(service: str, model: str) -> str:
    """`--service NAME` with several models: one service per model, NAME-MODEL, kept distinct (and valid: at most
    100 characters, ending in a letter or digit) by a hash of the whole when it must be cut."""
    import hashlib
    import re

    whole = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{service}-{model}")
    if len(whole) <= 100 and whole[-1].isalnum():
        return whole
    return f"{whole[:90]}-{hashlib.sha256(whole.encode()).hexdigest()[:8]}"


def load_eager(models: ModelSet) -> None:
    """Load the models that load at start-up (blocking); StartupError when one cannot."""
    for entry in models.entries.values():
        if entry.spec.eager:
            say(f"loading model {entry.name} from {entry.spec.config.model} ...")
            models.load_now(entry)


def front(models: ModelSet, settings: ServeSettings, api_key: str | None):
    """(the dispatching front over the models, the ASGI app to serve: the front behind the Host check when no API
    key is required)."""
    from .dispatch import Dispatch
    from .hosts import HostCheck, ServedHosts

    limits = settings.limits  # the largest body any model's app takes, and a form's own bytes around it
    dispatch = Dispatch(models, api_key, limits.default_timeout_s,
                        body_limit=max(limits.max_body_bytes, limits.max_upload_bytes) + 2**20)
    return dispatch, dispatch if api_key else HostCheck(dispatch, ServedHosts.of(settings.host,
                                                                                 settings.allowed_hosts))
