"""Measuring an executor: a latency model of its stages, and how large a batch fits in memory.

The SLO-aware strategy plans with a LatencyModel (stepserve.costs.latency_model); `stepserve profile` writes one to
a file. Both come from `measure_latency_model`, which runs the executor's own stages on dummy requests and keeps
the durations the executor reports (measured inside the executor, with the device synchronised; the fake
executor reports its cost model's numbers, so a model measured from it is exact).

Memory: `measure_peak_memory` runs one prepare + denoise + decode per batch size and reports the peak bytes it
needed on top of what was allocated before (the weights); `memory_cap` turns such peaks and a budget into the
largest batch size that fits; `cap_max_batch_size` does both for a configured max_batch_size and says why in one
line. What "peak" means depends on the device:

- CUDA: `torch.cuda.max_memory_allocated` over the run, less what was allocated before it: every tensor the run
  created (activations, latents, prompt embeddings, decoded images) at their highest point. Memory that the
  caching allocator keeps reserved but unused, and what CUDA libraries allocate on their own, are not in it.
- CPU: the bytes the torch CPU allocator handed out during the run, at their highest point, from the memory
  events of torch.profiler. Tensors only: memory that libraries allocate on their own (oneDNN or BLAS scratch
  space), Python objects and the C allocator's fragmentation are not counted. The headroom is there for these.

This module is a measuring tool and may read clocks (it times its own run for the metadata); the engine core
never does.
"""

from .measure import measure_latency_model, measure_with_and_without_guidance, profile_batch_sizes
from .memory import (
           cap_max_batch_size,
           format_bytes,
           measure_peak_memory,
           memory_budget,
           memory_cap,
)

__all__ = ["cap_max_batch_size", "format_bytes", "measure_latency_model", "measure_peak_memory",
           "measure_with_and_without_guidance", "memory_budget",
           "memory_cap", "profile_batch_sizes"]
