"""EngineCore: the loop body shared by the server, the offline API and the simulator.

step(now): take aborts and deadlines -> schedule -> execute (encode admitted, denoise, decode finished) ->
collect finished. Time is given, never read: the executor reports how long each stage took, and the core stamps
request timings as `now` plus those durations.

A step's host work does not grow with the queue: waiting requests are kept indexed by bucket and arrival order
(scheduling.queue.WaitingQueue, handed to the policy as it is), deadlines in a heap (lazy deletion: an entry of a
request that already ended is dropped when it comes up), and live requests by id for aborts. Only the running
set and the requests waiting for decode (both bounded by the batch) are scanned.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from .admission_errors import (AdmissionError, DeadlineInfeasibleError, DeadlineRefusedError,
                               QueueFullError)
from ..executor.base import Executor
from ..fleet.work import Tally
from ..scheduling import Policy
from ..scheduling.queue import Deadlines, WaitingQueue
from ..request.buckets import bucket_of
from ..request.types import FinishReason, Request, RequestStatus, SamplingParams, StepReport, next_request_id
from ..request.validation import first_denoising_step, resolve_params
from ..util.words import duration
from .stages import StageRunner

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, executor: Executor, policy: Policy, max_queue: int | None = None,
                 max_decode_per_step: int | None = None, answer_margin_s: float = 0.0) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1 or None (unbounded), got {max_queue}")
        if max_decode_per_step is not None and max_decode_per_step < 1:
            raise ValueError(f"max_decode_per_step must be >= 1 or None (all), got {max_decode_per_step}")
        if not 0.0 <= answer_margin_s < 60.0:
            raise ValueError(f"answer_margin_s must be in [0, 60) seconds, got {answer_margin_s}")
        self.executor = executor
        self.policy = policy
        self.max_queue = max_queue
        self.waiting = WaitingQueue()  # arrival order, indexed by bucket
        self.running: list[Request] = []  # admitted, still denoising: what the policy schedules
        # Denoised, waiting for the VAE. Out of the policy's sight, so their slots are free at once; at most
        # max_decode_per_step of them are decoded per step, which bounds the decode stall every running request
        # pays in that step (None: all of them in the step they finish).
        self.to_decode: deque[Request] = deque()
        self.max_decode_per_step = max_decode_per_step
        # Time kept, before a caller's deadline, to hand an image back (thread hand-off, encoding, the response):
        # a request's engine deadline is arrival + timeout_s - answer_margin_s, so an answer that is on time in
        # the engine is on time for the caller too.
        self.answer_margin_s = answer_margin_s
        self.draining = False  # no more arrivals expected: policies may flush partial batches
        self._aborts: set[str] = set()
        self._rejected: list[Request] = []  # reported by the next step
        self._deadlines = Deadlines()  # of every queued request that has one
        self._by_id: dict[str, list[Request]] = {}  # live requests (waiting, running, to decode) by request_id
        self.tally = Tally()  # the live requests per bucket, for the work in hand the fleet reads (fleet/work.py)
        self.stages = StageRunner(lambda r, t, message: self._finish(
            r, RequestStatus.FAILED, FinishReason.ERROR, t, message))

    @property
    def model_info(self):
        return self.executor.model_info

    # --- input -------------------------------------------------------------------------------------------------
    def add_request(self, params: SamplingParams, now: float, request_id: str | None = None,
                    preview_steps: frozenset[int] = frozenset()) -> Request:
        """Validate, decide admission and queue. Raises ValidationError on bad input and an AdmissionError
        (QueueFullError, DeadlineRefusedError) when the request is refused."""
        request = self.new_request(params, now, request_id, preview_steps)
        self.check_admission(request, now)
        self.enqueue(request)
        return request

    def new_request(self, params: SamplingParams, now: float, request_id: str | None = None,
                    preview_steps: frozenset[int] = frozenset()) -> Request:
        """Validate `params` and build the request that arrived at `now` (not queued yet)."""
        resolved = resolve_params(params, self.model_info)  # as it is when the edge resolved it (ResolvedParams)
        return Request(
            request_id=request_id or next_request_id(),
            params=resolved,
            arrival_time=now,
            bucket=bucket_of(resolved),
            num_inference_steps=resolved.num_inference_steps,
            deadline=None if resolved.timeout_s is None else now + resolved.timeout_s - self.answer_margin_s,
            priority=resolved.priority,
            preview_steps=frozenset(preview_steps),
            step=first_denoising_step(resolved, self.model_info),  # an input image skips the start of the schedule (img2img)
        )

    def check_admission(self, request: Request, now: float, ahead: Sequence[Request] = ()) -> None:
        """Refuse `request` (raise an AdmissionError, the request ended as REJECTED) when the queue bound or the
        policy's own admission rule says so. `ahead`: accepted requests not yet in the waiting queue (a front
        end's inbox, or earlier members of the same group). Reads the queues only; safe beside a running step."""
        if self.max_queue is not None and len(self.waiting) + len(ahead) >= self.max_queue:
            self._refuse(request, FinishReason.QUEUE_FULL, now,
                         f"queue is full ({self.max_queue} waiting); retry later", QueueFullError)
        admission = getattr(self.policy, "admission", None)
        if admission is None:
            return
        infeasible = getattr(self.policy, "infeasible", None)
        reason = infeasible(request, now) if infeasible is not None else None
        if reason is not None:
            self._refuse(request, FinishReason.DEADLINE_INFEASIBLE, now, reason, DeadlineInfeasibleError)
        # read lazily: a rule that admits the request at once (slo, without a deadline) never copies the queue
        reason = admission(request, itertools.chain(self.waiting, ahead), list(self.running), now)
        if reason is not None:
            waiting = list(self.waiting) + list(ahead)
            retry = self.policy.retry_after_s(waiting, list(self.running), now, request.bucket)
            self._refuse(request, FinishReason.DEADLINE_INFEASIBLE, now, reason, DeadlineRefusedError, retry)

    def enqueue(self, request: Request) -> None:
        """Queue a request that passed check_admission. Its deadline is read here; it must not change later."""
        self.waiting.append(request)
        self._by_id.setdefault(request.request_id, []).append(request)
        self.tally.add(request)
        if request.deadline is not None:
            self._deadlines.push(request, len(self.waiting) + len(self.running) + len(self.to_decode))

    def _refuse(self, request: Request, reason: FinishReason, now: float, message: str,
                error: type[AdmissionError], retry_after_s: float | None = None) -> None:
        self._finish(request, RequestStatus.REJECTED, reason, now, message)
        self._rejected.append(request)
        raise error(message, request, retry_after_s)

    def abort(self, request_id: str) -> None:
        """Ask for a request to be cancelled; it leaves (and frees its slot) at the start of the next step."""
        self._aborts.add(request_id)

    def cancel_now(self, request_ids: Iterable[str], now: float) -> list[Request]:
        """Cancel these requests at once, outside a step (a caller that stops driving the core, e.g. an
        interrupted offline generate()). Returns the requests that were still live."""
        gone = self._with_ids(request_ids)
        if not gone:
            return []
        return self._remove(gone, RequestStatus.CANCELLED, FinishReason.ABORTED, now,
                            "cancelled: the caller stopped before it finished")

    def earliest_deadline(self) -> float | None:
        """The earliest deadline of a live request (None: none has one)."""
        return self._deadlines.earliest() if len(self._deadlines) else None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.to_decode or self._aborts or self._rejected)

    # --- the step ----------------------------------------------------------------------------------------------
    def step(self, now: float) -> StepReport:
        finished = self._rejected
        self._rejected = []
        finished += self._take_aborts(now)
        finished += self._take_expired(now)

        try:
            plan = self.policy.schedule(self.waiting, list(self.running), now, draining=self.draining)
        except Exception as exc:  # noqa: BLE001 - a policy bug fails the requests it was deciding about
            log.exception("the %s batching policy raised; failing the requests it was scheduling", self.policy.name)
            message = f"internal error in the {self.policy.name} batching policy: {type(exc).__name__}: {exc}"
            finished += self._remove(list(self._all()), RequestStatus.FAILED, FinishReason.ERROR, now, message)
            return StepReport(now=now, duration_s=0.0, batch_size=0, finished=finished)
        if plan.give_up:  # the policy predicts these cannot meet their deadline any more: end them now
            finished += self._remove(plan.give_up, RequestStatus.FAILED, FinishReason.TIMEOUT, now,
                                     lambda r: f"deadline cannot be met: {progress_note(r, now)}")
        report = StepReport(now=now, duration_s=0.0, batch_size=0, wake_at=plan.wake_at)
        t = now

        if plan.admit:
            report.admitted = list(plan.admit)
            for r in plan.admit:
                self.waiting.discard(r)
                self.tally.started(r)
                r.status = RequestStatus.RUNNING
                r.timing.admitted = now
            self.running.extend(plan.admit)
            _, dt = self.stages.run(self.executor, "prepare", plan.admit, t, finished)
            report.encode_s = dt
            t += dt

        to_run = [r for r in plan.run if r.status is RequestStatus.RUNNING]
        if to_run:
            groups, dt = self.stages.run(self.executor, "denoise", to_run, t, finished)
            report.denoise_s = dt
            t += dt
            advanced = [r for g in groups for r in g]
            report.batch_size = max((len(g) for g in groups), default=0)
            report.progressed = advanced
            if len(groups) == 1 and hasattr(self.policy, "observe"):  # a cost-aware policy learns the step curve
                self.policy.observe(to_run[0].bucket, len(groups[0]), dt)
            tally = self.tally
            for g in groups:
                size = len(g)
                for r in g:
                    r.step += 1
                    tally.advanced(r.bucket, 1)
                    timing = r.timing
                    timing.batch_sizes.append(size)
                    if timing.first_step_done is None:
                        timing.first_step_done = t
            for r in advanced:
                if r.step >= r.num_inference_steps:
                    r.timing.denoise_done = t
                    self.to_decode.append(r)
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING and r.step < r.num_inference_steps]

        if self.to_decode:
            n = len(self.to_decode) if self.max_decode_per_step is None else self.max_decode_per_step
            done = [self.to_decode.popleft() for _ in range(min(n, len(self.to_decode)))]
            groups, dt = self.stages.run(self.executor, "decode", done, t, finished)
            report.decode_s = dt
            t += dt
            for g in groups:
                for r in g:
                    self._complete(r, t)
                finished += g

        report.duration_s = t - now
        report.finished = finished
        if report.duration_s == 0 and not finished:  # idle: also wake for the earliest deadline
            report.wake_at = self._wake_time(plan.wake_at)
        return report

    # --- helpers -----------------------------------------------------------------------------------------------
    def _complete(self, r: Request, t: float) -> None:
        """An image that is ready after its deadline is not an answer: the caller gave up at the deadline."""
        if r.deadline is not None and t > r.deadline:
            self._finish(r, RequestStatus.FAILED, FinishReason.TIMEOUT, t,
                         f"deadline passed (timeout_s={r.params.timeout_s:g}): finished all {r.num_inference_steps} steps "
                         f"{duration(t - r.deadline)} too late")
        else:
            self._finish(r, RequestStatus.COMPLETED, FinishReason.COMPLETED, t)

    def _wake_time(self, policy_wake: float | None) -> float | None:
        """When an idle engine must look again: the policy's own wake-up or the earliest deadline, if sooner."""
        times = [t for t in (self._deadlines.earliest(), policy_wake) if t is not None]
        return min(times) if times else None

    def _take_aborts(self, now: float) -> list[Request]:
        if not self._aborts:
            return []
        ids, self._aborts = self._aborts, set()
        return self._remove(self._with_ids(ids), RequestStatus.CANCELLED, FinishReason.ABORTED, now,
                            "aborted by the caller")

    def _take_expired(self, now: float) -> list[Request]:
        gone = self._deadlines.due(now)
        if not gone:
            return []
        return self._remove(gone, RequestStatus.FAILED, FinishReason.TIMEOUT, now,
                            lambda r: f"deadline passed (timeout_s={r.params.timeout_s:g}): {progress_note(r, now)}")

    def _with_ids(self, ids: Iterable[str]) -> list[Request]:
        return [r for i in set(ids) for r in self._by_id.get(i, ())]

    def _remove(self, requests: Iterable[Request], status: RequestStatus, reason: FinishReason, now: float,
                message: str | Callable[[Request], str]) -> list[Request]:
        """End these live requests (the others are skipped); returned in the order waiting (by arrival), running,
        to decode, as a scan of the core would list them."""
        gone = self._core_order(r for r in dict.fromkeys(requests) if not r.is_finished)
        if not gone:
            return []
        for r in gone:
            self.waiting.discard(r)
            self._finish(r, status, reason, now, message(r) if callable(message) else message)
        self.running = [r for r in self.running if not r.is_finished]
        self.to_decode = deque(r for r in self.to_decode if not r.is_finished)
        return gone

    def _core_order(self, requests: Iterable[Request]) -> list[Request]:
        """Live requests ordered as _all() yields them, without scanning the waiting queue."""
        requests = list(requests)
        if len(requests) < 2:
            return requests
        later = {r: i for i, r in enumerate(itertools.chain(self.running, self.to_decode))}
        waiting = [r for r in requests if r in self.waiting]
        waiting.sort(key=self.waiting.position)
        return waiting + sorted((r for r in requests if r in later), key=later.__getitem__)

    def _all(self) -> Iterable[Request]:
        yield from self.waiting
        yield from self.running
        yield from self.to_decode

    def _finish(self, r: Request, status: RequestStatus, reason: FinishReason, t: float,
                error: str | None = None) -> None:
        same = self._by_id.get(r.request_id)
        if same is not None and r in same:  # it leaves the core (a refused request never was in it)
            same.remove(r)
            self.tally.remove(r)
            if not same:
                del self._by_id[r.request_id]
        r.status = status
        r.finish_reason = reason
        r.error = error
        r.timing.finished = t
        if status is not RequestStatus.COMPLETED:
            r.image = None
            r.frames = None
        r.release_tensors()


def progress_note(r: Request, now: float) -> str:
    """What happened to a request so far, for error messages: queued for how long, or how far it ran."""
    if r.timing.admitted is None:
        return f"still queued after {duration(now - r.arrival_time)}"
    return f"ran {r.step} of {r.num_inference_steps} steps"
