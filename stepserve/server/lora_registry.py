"""Adapters registered once for every replica: POST /v1/loras writes a registration to the state store, and each
process serves the registrations it reads there (stepserve/store: AdapterRecord).

- A small sync (one asyncio task per app, started and stopped with it) reads the registrations every `period_s`:
  one this process does not serve yet becomes servable by its name, loaded on first use as folder adapters are; one
  marked deleted is deleted here (refused at once, unloaded once no request carries it: engine.delete_adapter). It
  then publishes the adapters this process holds loaded (`store.publish`, kept `ttl_s`), which GET /v1/loras shows
  as each adapter's replicas.
- A request naming an adapter this process has not heard of yet does not wait for the sync: the adapter store's
  resolver (this registry's `resolve`) looks the name up in the state store once, off the event loop.
- Every state-store call runs off the event loop (asyncio.to_thread); what touches the adapter store runs on the
  engine's adapter thread.

Registrations belong to a service (the app's jobs' service, server/jobs_app.py): a process serves, lists and
deletes only its own service's, and the holders GET /v1/loras shows are the replicas of its service.

Registrations are ordered by `registered_at` (the store's clock): this process acts on a registration only when it
is newer than the one it last saw under that name, so a pass that read the store before a POST or DELETE here
cannot undo it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import uuid
from dataclasses import asdict
from typing import Any

from ..lora import folder
from ..lora.errors import LoraError, LoraNotFoundError
from ..store.base import AdapterRecord, Store

log = logging.getLogger("stepserve.server")
INFO_FIELDS = ("path", "rank", "layers", "bytes", "text_encoder", "stack_bytes")


def default_replica_id() -> str:
    """A name for this process among the replicas: host, process id and a few random characters (two apps in one
    process are two replicas)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class AdapterRegistry:
    def __init__(self, engine, store: Store, replica: str | None = None, period_s: float = 1.0,
                 ttl_s: float = 5.0, service: str = "") -> None:
        self.engine = engine
        self.store = store
        self.service = service
        self.replica = replica or default_replica_id()
        self.period_s = period_s
        self.ttl_s = ttl_s
        self.passes = 0  # sync passes completed (tests wait on it)
        self._seen: dict[str, tuple[float, bool]] = {}  # name -> (registered_at, live) of the latest acted on
        self._task: asyncio.Task | None = None
        self._work: set[asyncio.Task] = set()  # deletions waiting for the requests that carry their adapter

    def local(self):
        """This engine's adapter store, or None where it has none or no folder (registrations are paths in it)."""
        served = self.engine.adapter_gate.served()
        return served if served is not None and served.root is not None else None

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        local = self.local()
        if local is None:
            return  # no adapter folder here: nothing registered can be served
        local.resolver = self.resolve
        self._task = asyncio.get_running_loop().create_task(self._run(), name="stepserve-lora-sync")

    async def close(self) -> None:
        local = self.local()
        if local is not None and local.resolver == self.resolve:
            local.resolver = None
        for task in [t for t in (self._task, *self._work) if t is not None]:
            task.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, *self._work, return_exceptions=True)
            try:
                await asyncio.to_thread(self._publish, {})  # held nothing from now on
            except Exception as exc:  # noqa: BLE001 - the store gone already: the publication expires by itself
                log.debug("LoRA sync: last publication failed: %s", exc)
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store unreachable for a moment: the next pass retries
                log.warning("LoRA sync: %s", exc)
            await asyncio.sleep(self.period_s)

    # --- one pass ------------------------------------------------------------------------------------------------
    async def sync_once(self) -> None:
        """Serve the registrations newer than those seen here, delete the deleted ones this process serves, then
        publish the adapters held here."""
        for record in await asyncio.to_thread(self.store.adapters, self.service):
            seen = self._seen.get(record.name)
            if record.deleted_at is None and (seen is None or record.registered_at > seen[0]):
                self._seen[record.name] = (record.registered_at, True)
                if seen is not None and seen[1]:  # registered again with another file: the old one goes first
                    self._spawn(self._replace(record))
                else:
                    await self._serve(record)
            elif record.deleted_at is not None and seen == (record.registered_at, True):
                self._seen[record.name] = (record.registered_at, False)
                self._spawn(self._unserve(record.name))
        local = self.local()
        held = {} if local is None else {n: _info(a) for n, a in dict(local.adapters).items()}
        await asyncio.to_thread(self._publish, held)
        self.passes += 1

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._work.add(task)
        task.add_done_callback(self._work.discard)

    async def _serve(self, record: AdapterRecord) -> None:
        try:
            await self.engine.register_adapter(record.name, record.path)
        except LoraError as exc:  # a request naming it is refused with this reason (resolve asks again)
            log.warning("LoRA adapter %r registered as %s cannot be served here: %s", record.name, record.path, exc)

    async def _unserve(self, name: str) -> None:
        try:  # refused from now on; unloaded once no request carries it, however long that takes (a DELETE here
            await self.engine.delete_adapter(name, wait_s=math.inf)  # gives up after 60 s and serves it again)
        except LoraNotFoundError:
            pass  # not served here (any more)
        except LoraError as exc:
            log.warning("LoRA adapter %r was deleted but is still served here: %s", name, exc)

    async def _replace(self, record: AdapterRecord) -> None:
        await self._unserve(record.name)
        await self._serve(record)

    def _publish(self, held: dict[str, dict]) -> None:
        """This replica's publication with its adapters (what else it publishes is kept)."""
        info = {**self.store.replicas().get(self.replica, {}), "adapters": held, "service": self.service}
        self.store.publish(self.replica, info, self.ttl_s)

    # --- what the handlers and the adapter store call ------------------------------------------------------------
    def resolve(self, name: str) -> str | None:
        """The adapter store's resolver (blocking: the engine's adapter thread calls it): the path of a live
        registration named `name`, else None."""
        record = next((r for r in self.store.adapters(self.service) if r.name == name and r.deleted_at is None), None)
        if record is None:
            return None
        seen = self._seen.get(name)
        if seen is None or record.registered_at > seen[0]:
            self._seen[name] = (record.registered_at, True)
        return record.path

    async def registration(self, name: str) -> AdapterRecord | None:
        """The live registration named `name`, if any."""
        records = await asyncio.to_thread(self.store.adapters, self.service)
        return next((r for r in records if r.name == name and r.deleted_at is None), None)

    async def register(self, name: str, path: str) -> AdapterRecord:
        """Write the registration of an adapter this process has just loaded (POST /v1/loras)."""
        def write() -> AdapterRecord:
            record = AdapterRecord(name, path, self.store.now(), service=self.service)
            self.store.register_adapter(record)
            return record

        record = await asyncio.to_thread(write)
        self._seen[name] = (record.registered_at, True)
        return record

    async def unregister(self, name: str) -> AdapterRecord | None:
        """Mark the registration deleted (DELETE /v1/loras/{name}); None when there was no live one."""
        record = await asyncio.to_thread(self.store.delete_adapter, name, self.service)
        if record is not None:
            self._seen[name] = (record.registered_at, False)
        return record

    async def restore(self, record: AdapterRecord) -> None:
        """Register again an adapter whose deletion failed here (it is still served here)."""
        await self.register(record.name, record.path)

    async def listing(self, local) -> list[dict[str, Any]]:
        """GET /v1/loras: the adapters servable here (the folder's, loaded ones) and every live registration,
        each with the replicas that hold it loaded now and its details where any replica has it loaded."""
        def read():
            return self.store.adapters(self.service), self.store.replicas(), local.names, local.files()

        records, replicas, names, files = await asyncio.to_thread(read)
        live = {r.name: r for r in records if r.deleted_at is None}
        here = {n: _info(a) for n, a in dict(local.adapters).items()}
        holders: dict[str, dict[str, dict]] = {}
        for replica, info in replicas.items():
            if replica != self.replica and info.get("service") == self.service:
                for name, details in (info.get("adapters") or {}).items():
                    holders.setdefault(name, {})[replica] = details
        for name, details in here.items():  # this process's own, as it is now
            holders.setdefault(name, {})[self.replica] = details
        out = []
        for name in sorted(set(names) | set(live) | set(here)):
            details = here.get(name) or next(iter(holders.get(name, {}).values()), None) or {}
            path = details.get("path") or (live[name].path if name in live else None)
            if path is None and name in files:
                path = folder.shown(local.root, files[name])
            out.append({"name": name, **{f: details.get(f) for f in INFO_FIELDS}, "path": path,
                        "registered": name in live, "replicas": sorted(holders.get(name, {}))})
        return out


def _info(adapter) -> dict[str, Any]:
    return {k: v for k, v in asdict(adapter).items() if k in INFO_FIELDS}
