"""One executor stage (prepare, denoise, decode) over a batch, with bisection on failure: when the executor raises
for a batch, the batch is split in halves and each half runs again, so only the request(s) that fail alone are
failed and the engine keeps serving. A failure kind is logged once per stage (a broken model fails every step)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..executor.base import Executor
from ..request.types import Request, RequestStatus

log = logging.getLogger("stepserve.engine.core")


class StageRunner:
    def __init__(self, fail: Callable[[Request, float, str], None]) -> None:
        self.fail = fail  # fail(request, t, message): end a request that failed alone
        self._logged: set[tuple[str, str]] = set()  # (stage, exception type) already logged

    def run(self, executor: Executor, stage: str, requests: list[Request], t: float,
            finished: list[Request]) -> tuple[list[list[Request]], float]:
        """Run `executor`'s `stage` over `requests` from time `t`. Returns the groups that ran (in order; each advanced
        together) and the seconds they took; requests that failed alone are ended and appended to `finished`."""
        try:
            return [requests], float(getattr(executor, stage)(requests))
        except Exception as exc:  # noqa: BLE001 - any model failure is reported to the affected requests
            if len(requests) > 1:
                half = len(requests) // 2
                first, dt1 = self.run(executor, stage, requests[:half], t, finished)
                second, dt2 = self.run(executor, stage, requests[half:], t + dt1, finished)
                return first + second, dt1 + dt2
            kind = (stage, type(exc).__name__)
            if kind not in self._logged:
                self._logged.add(kind)
                log.error("executor %s failed for request %s (alone); failing it", stage,
                          requests[0].request_id, exc_info=exc)
            for r in requests:
                if r.status is RequestStatus.RUNNING:
                    r.cause = exc  # typed ones (an add-on's) reach the client as what they are
                    self.fail(r, t, f"{stage} failed: {type(exc).__name__}: {exc}")
                    finished.append(r)
            return [], 0.0
