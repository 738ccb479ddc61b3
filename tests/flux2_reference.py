"""Flux.2 references for tests (klein and dev): diffusers' own pipeline of the folder (Flux2KleinPipeline or
Flux2Pipeline, as its model_index.json says) run alone per request, with the diffusers scheduler the request's
stepserve sampler reproduces; engines sharing one loaded executor per folder; the equality check."""

from __future__ import annotations

import numpy as np
import torch

from stepserve import Engine, SamplingParams

_PIPES: dict = {}
_EXECUTORS: dict = {}


def flux2_pipe(path):
    """(the folder's diffusers pipeline, its scheduler config as shipped), loaded once per folder."""
    from diffusers import DiffusionPipeline

    if str(path) not in _PIPES:
        pipe = DiffusionPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[str(path)] = (pipe, dict(pipe.scheduler.config))
    return _PIPES[str(path)]


def flux2_scheduler(sampler: str, config: dict):
    """flow_euler: the folder's FlowMatchEulerDiscreteScheduler; dpmpp_2m: DPM-Solver++(2M) with flow sigmas and
    velocity prediction from the same config (its dynamic shifting carried over), as for Flux.1."""
    import diffusers

    if sampler == "flow_euler":
        return diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    return diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=config["num_train_timesteps"], use_flow_sigmas=True, prediction_type="flow_prediction",
        flow_shift=config["shift"], use_dynamic_shifting=config["use_dynamic_shifting"], solver_order=2,
        algorithm_type="dpmsolver++", solver_type="midpoint")


def reference_image(path, p: SamplingParams) -> np.ndarray:
    """(H, W, 3) uint8 values (as int16) of request `p` (sampler, size, steps and guidance set) run alone."""
    pipe, config = flux2_pipe(path)
    pipe.scheduler = flux2_scheduler(p.sampler, config)
    image = pipe(prompt=p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def as_array(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def executor(path):
    """The folder's executor, loaded once (engines of every strategy share it)."""
    from stepserve.engine.loading import load_executor

    if str(path) not in _EXECUTORS:
        _EXECUTORS[str(path)] = load_executor(str(path))
    return _EXECUTORS[str(path)]


def shared_engine(path, strategy: str) -> Engine:
    return Engine(executor(path), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)


def check(results, params, references, strategy: str) -> None:
    """Every request served, in a shared batch (unless the strategy never batches), each image within 1 of its
    reference."""
    assert all(r.ok for r in results), [r.error for r in results]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, p, ref in zip(results, params, references):
        assert r.image.size == (p.width, p.height)
        diff = np.abs(as_array(r.image) - ref)
        assert diff.max() <= 1, (p, diff.max())
