"""The one budgeted store of named add-ons, which LoRA adapters (lora/store.py), ControlNets (controls/store.py)
and IP-Adapters (ipadapter/store.py) each keep one of: what is loaded and its bytes, the memory bound of that kind
(--lora-memory-mb, --controlnet-memory-mb, --ip-adapter-memory-mb), and which add-ons to unload to make room. Each
kind does its own loading (files, devices, modules); the decisions, and their errors, are made here once, so the
three kinds cannot drift apart.

- Size before load: a kind reserves an add-on's bytes (read from its files: addons/sizes.py) before it reads its
  weights; nothing is unloaded for an add-on that will not fit. Once loaded, its real size is settled (and checked
  again where it came out larger than reserved).
- Too large: an add-on larger than the whole memory (or the add-ons of one request together) can never be served:
  AddonTooLargeError, remembered by name and the stamp of its files, so asking again reads nothing.
- In flight: the add-ons that admitted, unfinished requests hold (`hold`, by the executor at a request's
  admission; released when the request finishes or is dropped) are never unloaded, whatever the current call
  names. One that does not fit beside them: AddonBudgetError (retry later). So two requests with different
  add-ons and room for one never unload each other's: the second waits for a retry instead of reloading every step.
- To make room, the least recently used idle add-ons are unloaded (they load again on their next use).
- Shared parts: an add-on may need a part that several share (IP-Adapters with one image encoder share one copy
  of it, as diffusers keeps one per pipeline). A part is an entry of its own, settled with the first add-on that
  loads it (`parts`), held while any add-on that needs it is, and unloaded only once no loaded add-on needs it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .errors import AddonBudgetError, AddonTooLargeError


@dataclass(frozen=True)
class Kind:
    """How one kind of add-on is named in messages, and its typed errors (subclasses of addons/errors.py's)."""

    noun: str  # "ControlNet"
    plural: str  # "ControlNets"
    memory: str  # "ControlNet memory"
    flag: str  # the flag that sets the memory: "--controlnet-memory-mb"
    too_large: type[AddonTooLargeError]
    held: type[AddonBudgetError]
    param: str | None  # the field the budget errors are about (None: the kind's errors' own default)


class Holder:
    """A holder that is not a request (a load between its reading and its use): held until released."""


def mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"


class AddonBudget:
    def __init__(self, kind: Kind, unload: Callable[[str], None], budget_bytes: int | None = None,
                 max_count: int | None = None) -> None:
        """`unload(name)`: free a loaded add-on (called under `mutex`, for the least recently used idle ones);
        `budget_bytes`: the memory of the loaded add-ons (None: no bound); `max_count`: at most this many."""
        self.kind = kind
        self.unload = unload
        self.budget_bytes = budget_bytes
        self.max_count = max_count
        self.mutex = threading.RLock()  # every decision of this store, and each kind's load of one name
        # the holders alone: a request's admission or step never waits for a load that holds `mutex`
        self._held_lock = threading.Lock()
        self.sizes: dict[str, int] = {}  # loaded add-ons -> their bytes
        self.last_used: dict[str, int] = {}  # name -> use counter at its last use (the least recent goes first)
        self.loads = 0
        self.evictions = 0
        self._uses = 0
        self._pending: dict[str, int] = {}  # reserved, being loaded: counted as loaded
        self._holders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> the names it holds
        self._too_large: dict[str, tuple[object, int]] = {}  # name -> (its files' stamp, its size)
        self.needs: dict[str, frozenset[str]] = {}  # an add-on -> the shared parts it needs loaded beside it

    def _with_parts(self, names: Iterable[str]) -> set[str]:
        names = set(names)
        return names | {p for n in names for p in self.needs.get(n, ())}

    # --- what requests hold -----------------------------------------------------------------------------------
    def hold(self, owner, names: Iterable[str]) -> None:
        """`owner` (a request: held until its `is_finished`, or until it is dropped; or a Holder, until released)
        uses `names`: none of them is unloaded meanwhile."""
        with self._held_lock:
            self._holders[owner] = self._holders.get(owner, frozenset()) | frozenset(names)

    def release(self, owner) -> None:
        with self._held_lock:
            self._holders.pop(owner, None)

    def in_use(self) -> set[str]:
        """The add-ons held by requests in flight (finished ones are forgotten here)."""
        with self._held_lock:
            held = list(self._holders.items())
            for owner, _ in held:
                if getattr(owner, "is_finished", False):
                    self._holders.pop(owner, None)
            return self._with_parts(n for owner, names in held if not getattr(owner, "is_finished", False)
                                    for n in names)

    def touch(self, names: Iterable[str]) -> None:
        """`names` were just used (the least recently used are unloaded first). Takes no lock: every step of a
        request with add-ons calls it, and a use counted a little out of order only reorders who goes first."""
        self._uses += 1
        for name in self._with_parts(names):
            self.last_used[name] = self._uses

    @property
    def loaded_bytes(self) -> int:
        return sum(self.sizes.values()) + sum(self._pending.values())

    # --- the decisions ----------------------------------------------------------------------------------------
    def remembered(self, name: str, stamp: object) -> None:
        """Raise the kind's too-large error, at once, for an add-on already found larger than the whole memory
        (and whose files have not changed since)."""
        seen = self._too_large.get(name)
        if seen is not None and seen[0] == stamp and self.budget_bytes is not None and seen[1] > self.budget_bytes:
            raise self._too_large_error(name, seen[1])

    def reserve(self, name: str, size: int, own: Iterable[str] = (), busy: Iterable[str] = (),
                stamp: object = None) -> None:
        """Make room for `name` (`size` bytes, known before it is loaded) beside `own` (the other add-ons of the
        request that needs it) and `busy` (add-ons the caller knows are in use), unloading least recently used
        idle ones; it counts as loaded until settle() or cancel(). Raises the kind's too-large error (it, or it
        with `own`, can never fit: remembered with `stamp`) or its held error (not beside those in use: retry
        later); then nothing was unloaded."""
        with self.mutex:
            self._check(name, size, set(own) - {name}, set(busy), stamp)
            self._make_room(set(own) | set(busy) | {name}, size, extra=1)
            self._pending[name] = size

    def settle(self, name: str, size: int, own: Iterable[str] = (), busy: Iterable[str] = (),
               stamp: object = None, parts: dict[str, int] | None = None) -> None:
        """`name` is loaded and takes `size` bytes, and `parts` (shared parts loaded with it, by name: their
        bytes) theirs. Where that is more than reserved it is checked again (raising as reserve() does: the caller
        then unloads it)."""
        with self.mutex:
            reserved = self._pending.pop(name, None)
            total = size + sum((parts or {}).values())
            if reserved is None or total > reserved:
                self._check(name, total, set(own) - {name}, set(busy), stamp)
            self.sizes.update(parts or {})
            self.sizes[name] = size
            self.loads += 1
            self.touch([name])
            self._make_room(set(own) | set(busy) | {name})

    def cancel(self, name: str) -> None:
        """A reserved load that failed: its room is free again."""
        with self.mutex:
            self._pending.pop(name, None)

    def drop(self, name: str) -> None:
        """`name` was unloaded by its kind (a deletion), not to make room."""
        with self.mutex:
            self.sizes.pop(name, None)

    def follow(self, keep: Iterable[str]) -> None:
        """Unload every loaded add-on (and shared part) that `keep` does not name and no holder holds: a worker rank
        of a parallel model (parallel/worker.py) keeps what rank 0 keeps, whose budget decides, and what its own
        requests still use. Not counted as evictions."""
        with self.mutex:
            keep = self._with_parts(set(keep) | self.in_use())
            while True:  # the add-ons first, then the parts no add-on left needs
                idle = [n for n in self.sizes if n not in keep and not self._needed_by_loaded(n)]
                if not idle:
                    return
                for name in idle:
                    self.unload(name)
                    self.sizes.pop(name, None)

    def _check(self, name: str, size: int, own: set[str], busy: set[str], stamp: object) -> None:
        k, budget = self.kind, self.budget_bytes
        held_names = self._with_parts(self.in_use() | busy | own | {name}) - {name}
        if self.max_count is not None and name not in self.sizes and \
                sum(n in held_names for n in self.sizes) + len(self._pending) + 1 > self.max_count:
            raise k.held(f"{self.max_count} {k.plural} are loaded, the most served at once, and requests are "
                         f"using them; retry later", k.param)
        if budget is None:
            return
        if size > budget:
            self._too_large[name] = (stamp, size)
            raise self._too_large_error(name, size)
        mine = sorted(n for n in self._with_parts(own | {name}) if n in self.sizes and n != name)
        together = size + sum(self.sizes[n] for n in mine)
        if together > budget:
            raise k.too_large(f"{k.plural} {', '.join(map(repr, [*mine, name]))} of one request take "
                              f"{mib(together)} together, more than the whole {k.memory} ({mib(budget)}, "
                              f"{k.flag}): they can never be served together; allowed: {k.plural} that fit it "
                              f"together", k.param)
        held = sum(s for n, s in self.sizes.items() if n in held_names) + \
            sum(s for n, s in self._pending.items() if n != name)
        if held + size > budget:
            users = ", ".join(sorted(held_names & set(self.sizes))) or "loads under way"
            raise k.held(f"{k.noun} {name!r} ({mib(size)}) does not fit the {k.memory} ({mib(budget)}, {k.flag}) "
                         f"beside the {k.plural} requests in flight use ({users}); retry later", k.param)

    def _too_large_error(self, name: str, size: int) -> AddonTooLargeError:
        k, budget = self.kind, mib(self.budget_bytes or 0)
        return k.too_large(f"{k.noun} {name!r} ({mib(size)}) is larger than the whole {k.memory} ({budget}, "
                           f"{k.flag}): it can never be loaded; allowed: {k.plural} up to {budget}", k.param)

    def _make_room(self, keep: set[str], need: int = 0, extra: int = 0) -> None:
        """Unload least recently used add-ons that nobody holds and `keep` does not name (nor a shared part a
        loaded add-on needs) while the memory (with `need` bytes more) is over the budget, or while `extra` more
        would be over the count."""
        keep = self._with_parts(keep | self.in_use())
        count = len(self.sizes) + len(self._pending)
        while (self.budget_bytes is not None and self.loaded_bytes + need > self.budget_bytes) or \
                (self.max_count is not None and count + extra > self.max_count):
            idle = [n for n in self.sizes if n not in keep and not self._needed_by_loaded(n)]
            if not idle:
                return
            name = min(idle, key=lambda n: self.last_used.get(n, 0))
            self.unload(name)
            self.sizes.pop(name, None)
            self.evictions += not any(name in parts for parts in self.needs.values())  # add-ons, not their parts
            count -= 1

    def _needed_by_loaded(self, part: str) -> bool:
        return any(part in self.needs.get(n, ()) for n in self.sizes if n != part)
