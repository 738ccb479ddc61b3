"""Engine.generate(): the offline API never leaves requests behind in the core."""

import pytest

from stepserve.api import Engine
from stepserve.engine.clock import SimClock
from stepserve.costs import FakeExecutor
from stepserve.request.types import RequestStatus, SamplingParams


def test_a_list_longer_than_the_queue_waits_for_room_and_leaves_no_orphans():
    engine = Engine(FakeExecutor(), clock=SimClock(), strategy="continuous", max_batch_size=2, max_queue=3)
    batch = [SamplingParams(prompt="a", seed=i, num_inference_steps=3) for i in range(10)]
    results = engine.generate(batch)
    assert [r.params.seed for r in results] == list(range(10))
    assert all(r.status is RequestStatus.COMPLETED for r in results)
    assert not engine.core.waiting and not engine.core.running
    again = engine.generate([SamplingParams(prompt="b", seed=99, num_inference_steps=2)])
    assert len(again) == 1 and again[0].ok and len(engine.executor.forward_batch_sizes) == 5 * 3 + 2


def test_an_interrupted_generate_leaves_nothing_for_the_next_call():
    class Boom(FakeExecutor):
        def __init__(self):
            super().__init__()
            self.armed = True

        def denoise(self, requests):
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt  # not an executor failure: escapes generate()
            return super().denoise(requests)

    ex = Boom()
    engine = Engine(ex, clock=SimClock(), strategy="continuous", max_batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([SamplingParams(prompt="a", seed=i, num_inference_steps=3) for i in range(4)])
    assert not engine.core.waiting and not engine.core.running
    results = engine.generate([SamplingParams(prompt="b", seed=7, num_inference_steps=2)])
    assert [r.params.seed for r in results] == [7] and results[0].ok
    assert ex.forward_batch_sizes == [1, 1]  # only the new request ran
