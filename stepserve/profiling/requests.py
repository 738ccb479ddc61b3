"""Dummy requests for measuring an executor: built as the engine builds them, run, then released."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from ..costs.latency_model import Bucket
from ..executor.base import Executor
from ..request.buckets import bucket_fields, bucket_of
from ..request.types import Request, RequestStatus
from ..request.validation import internal_params


# --- dummy requests -----------------------------------------------------------------------------------------------
def _dummy_requests(executor: Executor, n: int, bucket: Bucket, guidance_scale: float | None, tag: str,
                    seed_base: int = 0, cache: Any = "off", negative_prompt: str = "") -> list[Request]:
    """`n` requests as EngineCore.add_request makes them (resolved params, model defaults), admitted. Each has
    its own prompt so the text encoder runs on n prompts, and a fixed seed; `cache`: their step caching;
    `negative_prompt`: theirs."""
    model = executor.model_info
    out = []
    for i in range(n):
        params = internal_params(model, prompt=f"profile {tag} {i}", seed=seed_base + i,
                                 guidance_scale=guidance_scale, cache=cache, **bucket_fields(bucket),
                                 negative_prompt=negative_prompt)
        out.append(Request(
            request_id=f"profile-{tag}-{i}",
            params=params,
            arrival_time=0.0,
            bucket=bucket_of(params),
            num_inference_steps=params.num_inference_steps,
            deadline=None,
            priority=params.priority,
            status=RequestStatus.RUNNING,
        ))
    return out


def _release(requests: Iterable[Request]) -> None:
    for r in requests:
        r.release_tensors()
        r.image = None
        r.frames = None


@contextlib.contextmanager
def _no_prompt_cache(executor: Executor) -> Iterator[None]:
    """Run without the pipeline's prompt cache (when it has one), so that every prepare() pays for the text
    encoder (the cost of new prompts) and the profiling prompts do not stay in the cache afterwards."""
    pipeline = getattr(executor, "pipeline", None)
    cache = getattr(pipeline, "prompt_cache", None)
    if cache is None:
        yield
        return
    try:
        pipeline.prompt_cache = type(cache)(capacity=0)
    except Exception:  # noqa: BLE001 - a cache we do not know how to replace: measure with it (prompts are unique)
        yield
        return
    try:
        yield
    finally:
        pipeline.prompt_cache = cache


def _advance(requests: list[Request], executor: Executor) -> None:
    """Move every request one step on, as the engine does after a denoising step; a request that has taken all
    its steps is prepared again (untimed), so the next denoise() stays within its schedule."""
    for r in requests:
        r.step += 1
    if any(r.step >= r.num_inference_steps for r in requests):
        for r in requests:
            r.step = 0
        executor.prepare(requests)


# --- the latency model --------------------------------------------------------------------------------------------
def _device_of(executor: Executor) -> Any:
    return getattr(executor, "device", None)


def _dtype_of(executor: Executor) -> Any:
    dtype = getattr(executor, "dtype", None)
    if dtype is None:
        dtype = getattr(getattr(executor, "pipeline", None), "dtype", None)
    return dtype
