"""The fast path of the torch backend: a compiled denoiser per batch-size bucket (CUDA graphs on a GPU), channels_last,
and the deterministic mode (every forward at one fixed shape, so images are byte-identical whatever the load).

`apply_fast_path(executor, options, max_batch_size)` wraps the pipeline's networks in a BatchBucketedNetworks and warms
every bucket up with a real engine step (prepare, one denoising step, decode) of throwaway requests, so compiling
happens at start-up and never inside a served request.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from .batch_buckets import BatchBucketedNetworks, batch_buckets_up_to, check_batch_buckets

log = logging.getLogger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class FastPathOptions:
    compile: bool = False  # torch.compile the denoiser for each bucket
    deterministic: bool = False  # every forward at one fixed padded shape (byte-identical images under any load)
    batch_buckets: tuple[int, ...] | None = None  # denoiser batch sizes; None: powers of two up to 2 x max_batch_size
    compile_mode: str | None = None  # None: "reduce-overhead" (CUDA graphs per bucket) on CUDA, "default" on CPU
    compile_backend: str = "inductor"  # "aot_eager" traces without generating code (fast; for tests)
    channels_last: bool | None = None  # None: on CUDA only (convolutions there prefer NHWC)
    warm_up: bool = True
    progress: bool = True

    @property
    def enabled(self) -> bool:
        return self.compile or self.deterministic


def rows_for(max_batch_size: int) -> int:
    """The most denoiser rows one step can have: a conditional and an unconditional row per request."""
    return 2 * max_batch_size


def apply_fast_path(executor: Any, options: FastPathOptions, max_batch_size: int) -> BatchBucketedNetworks | None:
    """Wrap the executor's networks as `options` say (nothing when neither compile nor deterministic is set).
    Returns the wrapper."""
    if not options.enabled:
        return None
    pipeline = executor.pipeline
    if getattr(pipeline, "backend", "torch") != "torch":
        raise ValueError(f"--compile and --deterministic need --backend torch; got --backend {pipeline.backend}")
    if options.compile_mode is not None and options.compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode: {options.compile_mode!r} is not supported; allowed: {', '.join(COMPILE_MODES)}")
    if isinstance(pipeline.networks, BatchBucketedNetworks):
        raise ValueError("the fast path is already applied to this executor's networks")
    device = torch.device(pipeline.device)
    on_cuda = device.type == "cuda"
    inner = pipeline.networks
    rows = rows_for(max_batch_size)
    buckets = check_batch_buckets(options.batch_buckets) if options.batch_buckets else batch_buckets_up_to(rows)
    channels_last = on_cuda if options.channels_last is None else options.channels_last
    if channels_last and getattr(inner, "unet", None) is not None:
        inner.unet.to(memory_format=torch.channels_last)
    _prefer_sdpa(inner)
    mode = options.compile_mode or ("reduce-overhead" if on_cuda else "default")
    cuda_graphs = options.compile and on_cuda and mode == "reduce-overhead" and options.compile_backend == "inductor"
    denoise_fn = None
    if options.compile:
        # one graph per bucket (and per latent size): allow that many before dynamo falls back to eager
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 8 * len(buckets)))
        denoise_fn = torch.compile(inner.denoise, backend=options.compile_backend, dynamic=False,
                                   **({"mode": mode} if options.compile_backend == "inductor" else {}))
    if options.deterministic:
        _deterministic_kernels(on_cuda)
    fixed = rows if options.deterministic else None
    wrapper = BatchBucketedNetworks(inner, buckets, fixed_rows=fixed, fixed_other_rows=max_batch_size,
                               denoise_fn=denoise_fn, cuda_graphs=cuda_graphs, channels_last=channels_last)
    pipeline.networks = wrapper
    if hasattr(pipeline, "fixed_text_length"):  # text of its own length per prompt (Qwen-Image): one fixed length
        pipeline.fixed_text_length = pipeline.max_sequence_length
    if options.deterministic and hasattr(inner, "whole_batch_experts"):  # Wan 2.2: rows split between two experts
        inner.whole_batch_experts = True
    log.info("fast path: %s denoiser at batch sizes %s%s%s", f"compiled ({options.compile_backend}, {mode})"
             if options.compile else "eager", ", ".join(map(str, wrapper.batch_buckets)),
             ", CUDA graphs" if cuda_graphs else "", ", deterministic" if options.deterministic else "")
    mirror = getattr(executor, "mirror_fast_path", None)  # a parallel model's other ranks wrap theirs alike
    if mirror is not None:
        mirror(options, max_batch_size)
    if options.warm_up:
        warm_up(executor, wrapper, options.progress)
    return wrapper


def _prefer_sdpa(inner: Any) -> None:
    """Attention through torch's scaled_dot_product_attention (flash / memory-efficient kernels on GPUs). diffusers
    picks AttnProcessor2_0 (SDPA) by default; a module that still has the classic AttnProcessor is switched."""
    try:
        from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
    except ImportError:
        return
    for name in ("unet", "vae", "transformer"):
        module = getattr(inner, name, None)
        processors = getattr(module, "attn_processors", None)
        if processors and any(type(p) is AttnProcessor for p in processors.values()):
            module.set_attn_processor({k: AttnProcessor2_0() if type(p) is AttnProcessor else p
                                       for k, p in processors.items()})
            log.info("fast path: %s attention switched to scaled_dot_product_attention", name)


def _deterministic_kernels(on_cuda: bool) -> None:
    """On CUDA, the same shape must also pick the same kernels run after run: no autotuned convolution algorithms,
    cuBLAS with a fixed workspace (PyTorch's reproducibility notes)."""
    if not on_cuda:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def warm_up(executor: Any, wrapper: BatchBucketedNetworks, progress: bool = True) -> None:
    """Run one real step at every bucket (the model's default size): throwaway requests without guidance, one row
    each, then a decode, so every compiled shape is built before the first request arrives. With CUDA graphs each
    bucket runs three times: torch.compile's cudagraph trees run a new shape eagerly once, then record, then
    replay."""
    from ..util.progress import progress as progress_bar
    from ..request.buckets import bucket_of
    from ..request.types import Request
    from ..request.validation import internal_params

    model = executor.model_info
    params = internal_params(model, prompt="warm-up", seed=0, num_inference_steps=2, guidance_scale=1.0)
    bucket = bucket_of(params)
    with progress_bar(len(wrapper.batch_buckets), "warm-up", "batch size", disable=not progress) as bar:
        for size in wrapper.batch_buckets:
            requests = [Request(f"warm-up-{size}-{i}", params, 0.0, bucket, params.num_inference_steps)
                        for i in range(size)]
            executor.prepare(requests)
            for _ in range(3 if wrapper.cuda_graphs else 1):
                executor.denoise(requests)
            if size == wrapper.batch_buckets[0]:
                executor.decode(requests[:1])
            bar.update(1)
            bar.set_postfix(batch=size)
