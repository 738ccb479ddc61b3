"""The engine core's indexes of its requests: the waiting queue, in arrival order and by shape bucket, and the
deadlines in a heap.

Plain data (no clock, no I/O). The engine core keeps one and hands it to the policy at every step; a policy reads
the head of each bucket's queue (`buckets`, `head`, `count`) instead of scanning every waiting request, so a step
costs the same with ten requests queued as with ten thousand. Adding and removing a request cost O(1); listing the
buckets costs O(B log B) for B buckets with waiting requests.

The deadline heap lets a step find the requests whose deadline has passed without looking at the others.

Ordered indexes (`index`, `first`): a policy that serves each bucket in an order of its own (the slo policy:
priority, then deadline or remaining steps) registers it once; from then on every request queued is also pushed
into a heap per group (its bucket, say) by that key, and the first k of a group in that order are read in
O(k log k), whatever the queue's length. Keys must not change while a request waits (its priority, deadline,
remaining steps do not). Removed requests stay in the heaps until they come up (lazy deletion; a heap mostly of
removed entries is rebuilt, so this is amortised O(1)).

Iterating the queue yields every waiting request in arrival order (the order they were appended), as the plain
list it replaces did; policies that are given a plain sequence (tests, a front end's snapshot) wrap it with
`as_queue`.
"""

from __future__ import annotations

import heapq
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator

from ..request.buckets import Bucket
from ..request.types import Request


class WaitingQueue:
    """Waiting requests in arrival order, and per shape bucket in arrival order (an OrderedDict each)."""

    __slots__ = ("_all", "_by_bucket", "_seq", "urgent", "_indexes", "_steps")

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._all: OrderedDict[Request, int] = OrderedDict()  # request -> its arrival number
        self._by_bucket: dict[Bucket, OrderedDict[Request, int]] = {}
        self._seq = itertools.count()
        # waiting requests with a deadline or a non-zero priority: while there are none, arrival order is every
        # policy's service order, and the slo policy need not look past the head of each bucket
        self.urgent = 0
        self._indexes: dict[str, _Index] = {}
        self._steps: dict[Bucket, list[int]] = {}  # per bucket: [remaining steps, non-zero priorities] summed
        for r in requests:
            self.append(r)

    # --- changes (the engine core) -----------------------------------------------------------------------------
    def append(self, r: Request) -> None:
        if r in self._all:
            raise ValueError(f"request {r.request_id} is already waiting")
        n = next(self._seq)
        self._all[r] = n
        self.urgent += is_urgent(r)
        q = self._by_bucket.get(r.bucket)
        if q is None:
            q = self._by_bucket[r.bucket] = OrderedDict()
            self._steps[r.bucket] = [0, 0]
        q[r] = n
        sums = self._steps[r.bucket]
        sums[0] += r.num_inference_steps - r.step
        sums[1] += r.priority != 0
        for index in self._indexes.values():
            index.push(r, n)

    def remove(self, r: Request) -> None:
        """Take `r` out (KeyError when it is not waiting)."""
        del self._all[r]
        self.urgent -= is_urgent(r)
        q = self._by_bucket[r.bucket]
        del q[r]
        sums = self._steps[r.bucket]
        sums[0] -= r.num_inference_steps - r.step
        sums[1] -= r.priority != 0
        if not q:
            del self._by_bucket[r.bucket]
            del self._steps[r.bucket]

    def discard(self, r: Request) -> bool:
        """Take `r` out if it is waiting; whether it was."""
        if r not in self._all:
            return False
        self.remove(r)
        return True

    # --- reads (the policies) ----------------------------------------------------------------------------------
    def buckets(self) -> list[Bucket]:
        """Buckets that have waiting requests, ordered by their oldest waiting request."""
        return sorted(self._by_bucket, key=lambda b: next(iter(self._by_bucket[b].values())))

    def head(self, bucket: Bucket, k: int | None = None) -> list[Request]:
        """The first `k` (all, when None) waiting requests of `bucket`, in arrival order."""
        q = self._by_bucket.get(bucket)
        if not q:
            return []
        return list(q) if k is None else list(itertools.islice(q, max(k, 0)))

    def count(self, bucket: Bucket) -> int:
        q = self._by_bucket.get(bucket)
        return 0 if q is None else len(q)

    def steps(self, bucket: Bucket) -> int:
        """The remaining denoising steps of the waiting requests of `bucket`, summed."""
        sums = self._steps.get(bucket)
        return 0 if sums is None else sums[0]

    def prioritised(self, bucket: Bucket) -> int:
        """How many waiting requests of `bucket` have a non-zero priority."""
        sums = self._steps.get(bucket)
        return 0 if sums is None else sums[1]

    # --- ordered indexes -----------------------------------------------------------------------------------------
    def index(self, name: str, group: Callable[[Request], Hashable | None], key: Callable[[Request], tuple]) -> None:
        """Keep the waiting requests in heaps, one per group(r) (None: not indexed), ordered by key(r); built from
        the present queue the first time a name is given (the functions are not compared: one name, one index)."""
        if name not in self._indexes:
            index = self._indexes[name] = _Index(self, group, key)
            for r, n in self._all.items():
                index.push(r, n)

    def first(self, name: str, group: Hashable, k: int | None = None,
              skip: Callable[[Request], bool] | None = None) -> Iterator[Request]:
        """The waiting requests of `group` in index `name`'s order (at most k; those `skip` says not counted)."""
        index = self._indexes[name]
        return index.first(group, k, skip)

    def top(self, name: str, group: Hashable) -> Request | None:
        """The first waiting request of `group` in index `name`'s order (None: none)."""
        return self._indexes[name].top(group)

    def groups(self, name: str) -> list[Hashable]:
        """The groups of index `name` that may hold waiting requests (some may have only removed ones)."""
        return list(self._indexes[name].heaps)

    def position(self, r: Request) -> int:
        """A number that orders waiting requests by arrival (KeyError when `r` is not waiting)."""
        return self._all[r]

    def __contains__(self, r: object) -> bool:
        return r in self._all

    def __iter__(self) -> Iterator[Request]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def __bool__(self) -> bool:
        return bool(self._all)

    def __repr__(self) -> str:
        return f"WaitingQueue({len(self)} waiting in {len(self._by_bucket)} bucket(s))"


class _Index:
    """Heaps of (key, arrival number, request) per group, with lazy deletion: an entry is live while its request
    is waiting under that arrival number."""

    __slots__ = ("queue", "group", "key", "heaps")

    def __init__(self, queue: WaitingQueue, group, key) -> None:
        self.queue, self.group, self.key = queue, group, key
        self.heaps: dict[Hashable, list[tuple]] = {}

    def push(self, r: Request, n: int) -> None:
        g = self.group(r)
        if g is None:
            return
        heap = self.heaps.get(g)
        if heap is None:
            heap = self.heaps[g] = []
        elif len(heap) > 64 and len(heap) > 2 * len(self.queue):  # mostly removed entries: rebuild
            heap[:] = [e for e in heap if self._live(e)]
            heapq.heapify(heap)
        heapq.heappush(heap, (self.key(r), n, r))

    def _live(self, entry: tuple) -> bool:
        return self.queue._all.get(entry[2]) == entry[1]

    def top(self, g: Hashable) -> Request | None:
        heap = self.heaps.get(g)
        while heap and not self._live(heap[0]):  # drop removed entries from the top
            heapq.heappop(heap)
        if not heap:
            self.heaps.pop(g, None)
            return None
        return heap[0][2]

    def first(self, g: Hashable, k: int | None, skip) -> Iterator[Request]:
        """Live entries of group g in key order, without popping: a walk of the heap's tree, smallest first
        (O(m log m) for the m entries it passes)."""
        heap = self.heaps.get(g)
        if not heap:
            return
        while heap and not self._live(heap[0]):  # drop removed entries from the top
            heapq.heappop(heap)
        if not heap:
            del self.heaps[g]
            return
        frontier = [(heap[0], 0)]
        given = 0
        while frontier and (k is None or given < k):
            entry, i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if self._live(entry) and (skip is None or not skip(entry[2])):
                given += 1
                yield entry[2]


def is_urgent(r: Request) -> bool:
    """A request that changes a deadline-aware service order: it has a deadline or a non-zero priority."""
    return r.deadline is not None or r.priority != 0


def as_queue(waiting: Iterable[Request]) -> WaitingQueue:
    """`waiting` itself when it is a WaitingQueue, else a WaitingQueue of it (in its order; O(n))."""
    return waiting if isinstance(waiting, WaitingQueue) else WaitingQueue(waiting)


class Deadlines:
    """Deadlines of queued requests, earliest first (a heap). Lazy deletion: the entry of a request that ended is
    skipped when it comes up, and the heap is rebuilt when such entries are the majority. Entries hold weak
    references, so an ended request (and its image) is never kept alive by them. A request's deadline must not
    change once it is pushed."""

    __slots__ = ("_heap", "_numbers")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._numbers = itertools.count()  # ties: first pushed first

    def push(self, r: Request, live: int) -> None:
        """Track `r` (it has a deadline); `live`: how many requests are not ended, to bound the stale entries."""
        if len(self._heap) > 2 * live + 64:  # mostly entries of ended requests: rebuild (amortised O(1))
            self._heap = [e for e in self._heap if _live(e[2]) is not None]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (r.deadline, next(self._numbers), weakref.ref(r)))

    def due(self, now: float) -> list[Request]:
        """Take out the requests not ended whose deadline is at or before `now`, earliest first."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            r = _live(heapq.heappop(heap)[2])
            if r is not None:
                out.append(r)
        return out

    def earliest(self) -> float | None:
        """The earliest deadline of a request not ended (None: none)."""
        heap = self._heap
        while heap and _live(heap[0][2]) is None:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def __len__(self) -> int:
        return len(self._heap)


def _live(ref: weakref.ref) -> Request | None:
    r = ref()
    return None if r is None or r.is_finished else r
