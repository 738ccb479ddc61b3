"""Every batching strategy as a test parameter: the default (slo) in the default run, the others marked slow (they
run in `make test-slow`, which CI runs too). For the heavier equality tests of mixed batches, whose every strategy
costs seconds."""

import pytest

from stepserve.scheduling import STRATEGIES

FAST = ("slo",)
EVERY_STRATEGY = [s if s in FAST else pytest.param(s, marks=pytest.mark.slow) for s in STRATEGIES]
