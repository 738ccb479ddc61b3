"""The front end's side of LoRA serving (AsyncEngine): load what a request names before it is queued (it waits
there, never in a batch), refuse adapters that are being deleted, and delete one while serving.

One lock serialises loading and unloading with the admission of the requests that name adapters, so an adapter
loaded for a request cannot be unloaded to make room before that request is in the engine (from then on it is in
use, and the cache never unloads what requests in the engine carry)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

from .errors import LoraError


def _names(group) -> list[str]:
    return [name for r in group for name, _ in (r.params.loras or ())]


class AdapterGate:
    def __init__(self, executor, engine_lock: threading.Lock) -> None:
        self.executor = executor
        self.engine_lock = engine_lock  # the front end's admission lock
        self._lock = threading.Lock()
        self._carrying: list = []  # admitted requests that name adapters, until they end (their adapters stay)

    def _store(self):
        return getattr(self.executor, "_adapters", None)

    def in_use(self) -> set[str]:
        """Adapters that admitted requests carry until they end (a request counts from its admission to its
        final state, whatever queue it is in meanwhile)."""
        with self.engine_lock:
            self._carrying = [r for r in self._carrying if not r.status.finished]
            return set(_names(self._carrying))

    def needs_loading(self, group) -> bool:
        store = self._store()
        return store is not None and any(n not in store.adapters for n in _names(group))

    @contextlib.contextmanager
    def admitting(self, group) -> Iterator[None]:
        """Around a group's admission: its adapters loaded (the least recently used idle ones unloaded to make
        room) and kept until it is queued. Raises LoraError (an adapter that is no longer servable) or
        LoraBudgetError (the adapter memory is held by adapters in use; retry later)."""
        names = _names(group)
        if not names:
            yield
            return
        store = self.executor.adapters()
        with self._lock:
            store.ensure(names, self.in_use())
            yield

    def check(self, group) -> None:
        """Under the admission lock: no request may carry an adapter that is being deleted."""
        store = self._store()
        gone = store.retired if store is not None else ()
        for name in _names(group):
            if name in gone:
                raise LoraError(f"adapter {name!r} is being deleted; loaded: {', '.join(sorted(store.names)) or 'none'}")

    def track(self, group) -> None:
        """Under the admission lock, once `group` is admitted: its adapters are in use until its requests end."""
        self._carrying.extend(r for r in group if r.params.loras)

    def load(self, name: str, path) -> object:
        """POST /v1/loras: load a file under a name within the memory budget (as first use does)."""
        store = self.executor.adapters()
        with self._lock:
            return store.load_within_budget(name, path, self.in_use())

    async def delete(self, name: str, wait_s: float = 60.0) -> None:
        """Unload adapter `name` while serving: refuse new requests that name it, wait (up to wait_s) until no
        request carries it, then unload it between two steps. Raises LoraError."""
        store = self.executor.adapters()
        with self.engine_lock:
            store.retire(name)
        try:
            deadline = time.monotonic() + wait_s
            while name in self.in_use():
                if time.monotonic() > deadline:
                    raise LoraError(f"adapter {name!r} is still carried by requests after {wait_s:g} s; not deleted")
                await asyncio.sleep(0.05)

            def unload() -> None:
                with self._lock:
                    store.delete(name)

            await asyncio.to_thread(unload)
        finally:
            if name in store.adapters:  # not deleted (timed out, interrupted): servable again
                store.unretire(name)
