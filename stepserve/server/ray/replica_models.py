"""A replica of a server of several models (`serve --model a=... --model b=... --replicas N`): every replica builds
every model (server/models_setup.py, as `serve` does in one process) on its own shared device, behind the same
dispatching front, and tells the routers where its models are.

- Its routing stats (router.py) are its engines' together: the work in hand of all of them (they take turns on one
  device), their requests, the tightest slack, the adapters of any; the curve a newcomer is priced at is the
  default model's. Besides, `models`: every name it serves -> where that model is ("device", "host" or "disk"),
  for the routers' model affinity (fleet/routers.py, model_tiers).
- Ray Serve's own router (power_of_two, the default) knows nothing of those stats; it prefers the replicas that
  report the request's `serve_multiplexed_model_id` among their multiplexed model ids. So the replica reports, as
  those ids, the names of the models on its device, each time that set changes (`push_model_ids`), through the
  same controller call Ray's `@serve.multiplexed` makes (private to Ray Serve: a failure is logged, never raised).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from ...fleet.stats import ReplicaStats
from ..replica_header import ReplicaHeader
from ..models_setup import ModelsConfig, front, load_eager, model_set
from .fleet import autoscaling_of, engine_stats, published
from .load import background_jobs

log = logging.getLogger("stepserve.server")
MODEL_IDS_EVERY_S = 0.25  # how often a replica checks which models are on its device (reported when that changes)


class ReplicaModels:
    """The models of one replica, their front, and what the replica tells Ray about them."""

    def __init__(self, config: ModelsConfig, settings, store, results, replica: str, api_key: str | None,
                 webhook_secret: str | None) -> None:
        self.models = model_set(config, settings, store, results, owner=replica, replica=replica, api_key=api_key,
                                webhook_secret=webhook_secret, access_log=False)  # Ray Serve logs every request
        load_eager(self.models)
        self.dispatch, app = front(self.models, settings, api_key)
        self.app = ReplicaHeader(app, replica)  # the front's own answers too: Ray's proxy rewrites unnamed errors
        self.pushed: tuple[str, ...] | None = None  # the model ids last reported to Ray Serve

    def loaded(self) -> list:
        """The loaded models' entries, the default first (its quote prices the requests)."""
        entries = self.models.entries
        order = [entries[self.models.default], *(e for n, e in entries.items() if n != self.models.default)]
        return [e for e in order if e.engine is not None and e.stack is not None]

    def places(self) -> dict[str, str]:
        """Every name a request may give -> where its model is now (device, host, disk)."""
        place = {e.name: self.models.card(e)["place"] for e in self.models.entries.values()}
        return {name: place[model] for name, model in self.models.names.items()}

    def background_jobs(self) -> int:
        return sum(background_jobs(app) for app in self.dispatch.apps())

    def routing_stats(self) -> dict:
        """Ray Serve's record_routing_stats: the engines' stats together and where each model is."""
        stats, steps = self.stats()
        return published(stats, steps, self.places())

    def autoscaling_stats(self) -> dict:
        return autoscaling_of(self.stats()[0])

    def stats(self) -> tuple[ReplicaStats, int | None]:
        """(the engines' stats together, the default steps of the first loaded model: None when none is)."""
        loaded = self.loaded()
        if not loaded:
            return ReplicaStats(), None  # idle: nothing loaded yet (models loaded on first use)
        parts = [engine_stats(e.engine, background_jobs(e.app)) for e in loaded]
        first = parts[0]
        together = replace(first, outstanding=sum(p.outstanding for p in parts), work_s=sum(p.work_s for p in parts),
                           adapters=frozenset().union(*(p.adapters for p in parts)),
                           slack_s=min(p.slack_s for p in parts), jobs=sum(p.jobs for p in parts))
        return together, loaded[0].engine.model_info.default_steps

    def failure(self) -> str | None:
        """Why a loaded model's engine failed (Ray then replaces the replica), or None."""
        failed = [e for e in self.loaded() if not e.engine.healthy]
        return "; ".join(f"model {e.name}: {e.engine.failure}" for e in failed) or None

    def on_device(self) -> tuple[str, ...]:
        """The names (aliases too) of the models on the device: the multiplexed model ids this replica reports."""
        return tuple(sorted(n for n, place in self.places().items() if place == "device"))

    def push_model_ids(self, replica_id: Any) -> None:
        """Report the models on the device to Ray Serve's controller when that set changed (for Ray's own router)."""
        ids = self.on_device()
        if ids == self.pushed:
            return
        try:
            from ray.serve._private.common import RequestRoutingInfo
            from ray.serve.context import _get_global_client

            _get_global_client().record_request_routing_info(RequestRoutingInfo(replica_id, list(ids)))
        except Exception as exc:  # noqa: BLE001 - Ray's private API changed, or the controller is gone
            log.warning("cannot report the models on this replica's device to Ray Serve: %s", exc)
            return
        self.pushed = ids

    async def push_model_ids_forever(self, replica_id: Any) -> None:
        while True:
            self.push_model_ids(replica_id)
            await asyncio.sleep(MODEL_IDS_EVERY_S)
