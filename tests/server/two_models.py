"""A server of two models for the console's tests: two engines on one shared device behind the front
(server/dispatch.py), built as `serve --model a=... --model b=...` builds them (commands/serve_models.py), served
by uvicorn in a thread."""

from __future__ import annotations

import contextlib

from server_helpers import ServerThread


@contextlib.contextmanager
def two_models(paths: dict[str, str], eager: tuple[str, ...] | None = None, **options):
    """A front serving `paths` (name -> model: 'embedded' or a folder), the first the default; the names in `eager`
    (default: all) are loaded before it starts, the others on their first request. Yields (server, models)."""
    from stepserve.engine.config import EngineConfig, EngineOptions
    from stepserve.engine.device import SharedDevice
    from stepserve.scheduling.device_share import DeviceShare
    from stepserve.server.app import create_app
    from stepserve.server.dispatch import Dispatch
    from stepserve.server.models import ModelSet, ModelSpec
    from stepserve.server.schemas import ServerLimits

    eager = tuple(paths) if eager is None else eager
    engine_options = EngineOptions(**{"strategy": "continuous", "max_batch_size": 4, **options})
    specs = [ModelSpec(name, EngineConfig(model=path, warm_up=False, memory_cap=False, options=engine_options),
                       eager=name in eager) for name, path in paths.items()]
    device = SharedDevice(DeviceShare({s.name: s.weight for s in specs}))

    def make_app(spec, engine):
        limits = ServerLimits(served_model_names=(spec.name,), other_models=tuple(n for n in paths if n != spec.name))
        return create_app(engine, limits=limits, shutdown_grace_s=5.0, access_log=False,
                          service=f"console-test-{spec.name}")

    models = ModelSet(specs, specs[0].name, device, make_app)
    for entry in models.entries.values():
        if entry.spec.eager:
            models.load_now(entry)
    with ServerThread(Dispatch(models, None, None)) as server:
        yield server, models
