"""The nothing-lost check shared by the lifecycle property tests: drive a core through a trace and assert every
request ends in exactly one final state, reported once, with its tensors freed, and the engine ends empty."""

from __future__ import annotations

from collections.abc import Callable

from stepserve.engine.core import EngineCore
from stepserve.sim import Arrival, simulate
from stepserve.request.types import RequestStatus, StepReport

FINAL = {RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.REJECTED}


def every_nth_call_fails(n: int | None) -> Callable[[str, list], bool]:
    """A FakeExecutor fault hook: every n-th stage call raises (never, with None)."""
    calls = {"n": 0}

    def fault(stage, requests) -> bool:
        calls["n"] += 1
        return n is not None and calls["n"] % n == 0

    return fault


def assert_nothing_lost(core: EngineCore, trace: list[Arrival],
                        each_step: Callable[[StepReport], None] | None = None) -> None:
    seen: dict[str, RequestStatus] = {}

    def on_step(report: StepReport) -> None:
        if each_step is not None:
            each_step(report)
        for r in report.finished:
            assert r.request_id not in seen, "a request was finished twice"
            seen[r.request_id] = r.status

    res = simulate(core, trace, on_step=on_step)
    assert len(res.requests) == len(trace)
    for r in res.requests:
        assert r.status in FINAL
        assert seen[r.request_id] is r.status  # reported exactly once, with its final status
        assert r.finish_reason is not None
        if r.status is RequestStatus.COMPLETED:
            assert r.step == r.num_inference_steps and r.image is not None
            assert r.timing.batch_sizes and len(r.timing.batch_sizes) == r.num_inference_steps
        else:
            assert r.error, "a request that did not complete must say why"
        assert r.latents is None and r.sampler_state is None  # its tensors were freed
    assert not core.waiting and not core.running and not core.to_decode and not core.has_work()
