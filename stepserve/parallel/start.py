"""Start a model's other ranks beside rank 0's loaded executor (build_engine calls this on a parallel config)."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .degrees import check_family
from .executor import ParallelExecutor
from .ranks import Ranks, RanksLost


def start_ranks(local: Any, config, say: Callable[[str], None]) -> ParallelExecutor:
    """The workers load the model (meanwhile this rank's is checked), join torch.distributed with this rank, and
    split the transformer as this rank does. `config`: the EngineConfig, whose `degrees` are enabled. Raises
    ValueError (one line) for a model that cannot run at these degrees or a worker that could not start."""
    degrees = config.degrees
    pipeline = local.pipeline
    transformer = getattr(pipeline.networks, "transformer", None)
    heads = getattr(getattr(transformer, "config", None), "num_attention_heads", None)
    check_family(degrees, pipeline.capabilities, heads)
    if degrees.sequence > 1:
        pipeline.check_sequence_degree(degrees.sequence)  # a text the family's plan splits too (Flux.1, Flux.2)
    import torch.distributed as dist

    if dist.is_initialized():  # torch.distributed has one default group per process
        raise ValueError(f"{degrees.describe()}: another parallel model runs in this process (one per process: "
                         f"close it first with engine.executor.close(), or serve this one in its own process)")
    # what a worker loads: the model and its add-on folders; no batching options, checks or warm-up of its own
    worker_config = replace(config, degrees=None, options=None, fast_path=None, memory_cap=False, warm_up=False)
    try:
        ranks = Ranks(degrees, worker_config, config.threads or 1)
    except RanksLost as exc:  # a worker ended before it dialed back (Ranks stopped the others)
        raise ValueError(f"{degrees.describe()}: {exc}") from None
    atexit.register(ranks.close)
    try:
        for reply in ranks.replies(timeout_s=None):  # each worker loaded its copy of the model (its death ends it)
            if reply[0] != "ready":
                raise ValueError(f"{degrees.describe()}: {reply[1] if len(reply) > 1 else reply}")
        ranks.join_group()
        from .split import apply_split

        local.split = apply_split(pipeline, degrees)
    except RanksLost as exc:
        ranks.close()
        raise ValueError(f"{degrees.describe()}: {exc}") from None
    except BaseException:
        ranks.close()
        raise
    say(f"{degrees.describe()}: {degrees.world} ranks (rank 0 here, {degrees.world - 1} worker process(es)) split "
        f"each forward")
    return ParallelExecutor(local, ranks)
