"""The front end's side of LoRA serving (AsyncEngine): load what a request names before it is queued (it waits
there, never in a batch), refuse adapters that are being deleted, and delete one while serving.

One lock serialises loading, unloading and evicting with the admission of the requests that name adapters, so an
adapter loaded for a request cannot be unloaded to make room before that request is accepted (from then on it is
in use, and the cache never unloads what accepted requests carry). That lock is held across file reads and the
wait for a step, so the event loop never waits on it: it only tries it (`admitting(group, wait=False)`), and
everything that must wait runs on a thread of the engine's own.

What is in use: the adapters of the requests accepted and not yet queued (`pending`, the front end's inbox) and
of the requests queued and not yet ended. A request that never gets queued carries nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass

from . import folder
from .errors import LoraError, LoraInUseError, not_loaded
from .spec import requested_names

log = logging.getLogger(__name__)


def _names(group) -> list[str]:
    return [name for r in group for name, _ in (r.params.loras or ())]


@dataclass(frozen=True)
class Deletion:
    """What DELETE did: `unloaded` (False: it was not loaded, e.g. unloaded earlier to make room) and whether it is
    still servable (`reloadable`: its file in the adapter folder loads again when a request names it)."""

    name: str
    unloaded: bool
    reloadable: bool


class AdapterGate:
    def __init__(self, executor, engine_lock: threading.Lock, pending: Callable[[], Iterable] = tuple) -> None:
        self.executor = executor
        self.engine_lock = engine_lock  # the front end's admission lock (short holds only)
        self.pending = pending  # requests accepted and not yet queued; read under engine_lock
        self._lock = threading.Lock()
        self._carrying: list = []  # queued requests that name adapters, until they end (their adapters stay)

    def served(self):
        """The adapter store, where this engine has one (None: it serves no adapters, or none were asked for)."""
        return getattr(self.executor, "_adapters", None)

    def in_use(self) -> set[str]:
        """Adapters that accepted requests carry until they end (a request counts from its acceptance to its
        final state, whatever queue it is in meanwhile)."""
        with self.engine_lock:
            self._carrying = [r for r in self._carrying if not r.status.finished]
            return set(_names(self._carrying)) | set(_names(self.pending()))

    @contextlib.contextmanager
    def admitting(self, group, wait: bool = True) -> Iterator[bool]:
        """Around a group's admission: its adapters loaded (the least recently used idle ones unloaded to make
        room) and kept until it is accepted. Yields whether the admission may go on: with wait=False, False when
        an adapter must be loaded first or a load or delete holds the gate (then nothing was done; admit again
        with wait=True off the event loop). Raises LoraError (an adapter that is no longer servable) or
        LoraBudgetError (the adapter memory is held by adapters in use; retry later)."""
        names = _names(group)
        if not names:
            yield True
            return
        store = self.executor.adapters()
        if not self._lock.acquire(blocking=wait):
            yield False
            return
        try:
            if not wait and any(n not in store.adapters for n in names):
                yield False
                return
            store.ensure(names, self.in_use())
            yield True
        finally:
            self._lock.release()

    def check(self, group) -> None:
        """Under the admission lock: no request may carry an adapter that is being deleted."""
        store = self.served()
        gone = store.retired if store is not None else ()
        for name in _names(group):
            if name in gone:
                loaded = ", ".join(sorted(store.names)) or "none"
                raise LoraError(f"adapter {name!r} is being deleted; loaded: {loaded}", "loras")

    def track(self, requests) -> None:
        """Under the admission lock, once `requests` are queued: their adapters are in use until they end."""
        self._carrying.extend(r for r in requests if r.params.loras)

    def unknown(self, params) -> list[str]:
        """The adapter names these SamplingParams give that are not served here but that the store's resolver may
        know (registered elsewhere); none without a resolver. Cheap: on the event loop."""
        store = self.served()
        if store is None or store.resolver is None:
            return []
        served = store.names
        return sorted({n for p in params for n in requested_names(p.loras) if n not in served})

    def resolve(self, names) -> None:
        """Ask the resolver once for each name still not served, and serve what it names (loaded on first use).
        Blocks (the resolver reads the state store): call it off the event loop. Raises LoraError for a
        registration this server cannot serve (say, its file is missing here); a name the resolver does not know
        is left to the request's validation to refuse."""
        store = self.served()
        for name in names:
            if name in store.names:
                continue
            try:
                folder.check_name(name)
                path = store.resolver(name)
            except LoraError:
                continue  # not a name at all: validation says so
            except Exception as exc:  # noqa: BLE001 - the state store unreachable: refused as unknown, and logged
                log.warning("LoRA adapter %r: the registrations could not be read: %s", name, exc)
                continue
            if path is not None:
                self.register(name, path)

    def register(self, name: str, path) -> bool:
        """Serve `path` as `name`, loaded on first use (AdapterStore.register). Blocks: call it off the loop."""
        return self.executor.adapters().register(name, path)

    def load(self, name: str, path) -> object:
        """POST /v1/loras: load a file under a name within the memory budget (as first use does). Blocks: call it
        off the event loop."""
        store = self.executor.adapters()
        with self._lock:
            return store.load_within_budget(name, path, self.in_use())

    async def delete(self, name: str, off_loop: Callable[..., Awaitable], wait_s: float = 60.0) -> Deletion:
        """Unload adapter `name` while serving: refuse new requests that name it, wait (up to wait_s) until no
        request carries it, then unload it between two steps. `off_loop(fn, *args)` runs what takes the gate's
        lock off the event loop. An adapter that is not loaded but is in the adapter folder is no error (Deletion
        says so). Raises LoraNotFoundError, LoraInUseError."""
        store = self.executor.adapters()
        if not await off_loop(self._retire, store, name):
            return Deletion(name, unloaded=False, reloadable=name in store.names)
        try:
            deadline = time.monotonic() + wait_s
            while name in self.in_use():
                if time.monotonic() > deadline:
                    raise LoraInUseError(f"adapter {name!r} is still carried by requests after {wait_s:g} s; not "
                                         f"deleted (retry once they end)")
                await asyncio.sleep(0.05)
            await off_loop(self._unload, store, name)
        finally:
            if name in store.adapters:  # not deleted (timed out, interrupted): servable again
                store.unretire(name)
        return Deletion(name, unloaded=True, reloadable=name in store.files())

    def _retire(self, store, name: str) -> bool:
        """Under the gate's lock (no eviction races it): True when `name` was loaded and is now refused to new
        requests; False when it is not loaded (evicted, or never used): a file of its own (POSTed, registered) is
        forgotten at once (no request carries an adapter that is not loaded), a folder file stays servable."""
        with self._lock:
            if name in store.retired:
                raise LoraInUseError(f"adapter {name!r} is being deleted already")
            if name in store.adapters:
                with self.engine_lock:
                    store.retire(name)
                return True
            if name in store.sources:
                store.delete(name)
                return False
            if name in store.files():
                return False
            raise not_loaded(name, store.names)

    def _unload(self, store, name: str) -> None:
        with self._lock:
            if name in store.adapters:  # else evicted meanwhile: gone all the same
                store.delete(name)
