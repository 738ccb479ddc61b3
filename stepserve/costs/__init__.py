"""Costs: what the engine's stages take, and the fake executor that charges them.

- `LatencyModel` (latency_model.py): measured curves per stage and shape bucket; the `slo` policy plans with it,
  `stepserve profile` (stepserve.profiling) measures it.
- Curves with and without guidance rows (guidance.py), kept in a latency model's metadata.
- `CostModel` (cost_model.py): the simplest cost function, fixed + per-item seconds.
- `LatencyCharges` (charges.py): the cost function read from a LatencyModel, optionally with measured noise.
- `FakeExecutor` (fake.py): runs no network; charges a cost function, on a simulated clock or really sleeping.

Pure data and arithmetic: nothing here imports torch, and only the fake executor's sleeping mode reads a clock (it
times its own sleep), so the policies in stepserve.scheduling can import the latency model.
"""

from .charges import LatencyCharges
from .cost_model import CostModel
from .fake import FAKE_MODEL, Cost, FakeExecutor, model_for
from .latency_model import Bucket, Curve, LatencyModel

__all__ = ["FAKE_MODEL", "Bucket", "Cost", "CostModel", "Curve", "FakeExecutor", "LatencyCharges", "LatencyModel",
           "model_for"]
