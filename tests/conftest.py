import atexit
import os
import shutil
import tempfile

# OpenMP's threads sleep when they wait instead of spinning: with the cores shared (another test run, a server this
# suite started, the other developers' work), spinning threads took the CPU from the ones with work to do and made
# compute-bound tests several times slower (a LoRA test: 26 s with passive waits, 120 s spinning, beside a busy
# loop). Set before torch loads its OpenMP runtime; the servers and commands the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# `stepserve serve` keeps its state (jobs, adapter registrations) in the user's state directory by default: the
# servers the tests start keep theirs in a folder of this test session's own, removed at its end, and never read a
# STEPSERVE_STATE set for real use.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="stepserve-test-state-")
atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], True)
os.environ.pop("STEPSERVE_STATE", None)

import torch  # noqa: E402

# Deterministic, quiet, and sized for a 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from hypothesis import HealthCheck, settings

import stepserve.api as _api

# Property tests run on a machine whose cores other work may share: Hypothesis's health check that fails a test
# whose examples are slow to generate would then fail it for the machine's load, with no example to show. Its
# deadlines are off for the same reason; a property still fails on any counterexample.
settings.register_profile("shared-machine", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("shared-machine")

# Engine.from_pretrained's default thread count leaves a core to whatever feeds the engine (a server, a load
# generator); the suite runs nothing beside it, so it keeps the threads set above.
_api._auto_threads = lambda: torch.get_num_threads()


@pytest.fixture(scope="session")
def tiny_sd_path(tmp_path_factory):
    from tiny_sd import build_tiny_sd

    return build_tiny_sd(tmp_path_factory.mktemp("tiny_sd") / "pipe")


@pytest.fixture(scope="session")
def tiny_sd_vpred_path(tmp_path_factory):
    from tiny_sd import build_tiny_sd

    return build_tiny_sd(tmp_path_factory.mktemp("tiny_sd_v") / "pipe", prediction_type="v_prediction",
                         scheduler="EulerDiscreteScheduler", seed=1)


@pytest.fixture
def batching_pays(monkeypatch):
    """Tests of batch invariance need requests to share batches. The cost-aware strategies (slo, adaptive) size
    each batch from the step times they measure, and on a busy machine those can say that batching does not pay,
    so that every request runs alone. These tests pin the step curve's answer to "all of them"; the choice itself
    is tested with exact costs (tests/costs/test_online_curve.py, tests/scheduling/test_adaptive.py)."""
    from stepserve.costs.online import OnlineStepCurve

    monkeypatch.setattr(OnlineStepCurve, "efficient_batch",
                        lambda self, bucket, available, *args, **kwargs: available)


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run only with STEPSERVE_SLOW=1 or when -m names them."""
    if os.environ.get("STEPSERVE_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: set STEPSERVE_SLOW=1 (or -m slow) to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
