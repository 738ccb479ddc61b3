"""Engine overhead at saturation: continuous batching vs a bare loop over the same pipeline forward.

For each max_batch_size B, both sides generate the same N images (same prompts, seeds, steps, guidance, sampler):
- bare: batches of B, encode -> per step (model_inputs, one UNet forward with CFG rows, sampler_step) -> decode,
  with no engine, no scheduling, no per-request bookkeeping;
- engine: Engine(strategy="continuous", max_batch_size=B).generate(all N at once).
It prints images/s of each, their ratio, and the per-step host overhead: the wall time of a pure denoising step
minus the time inside the UNet forward (so: scheduling, gather/scatter of per-request latents, guidance mixing and
sampler math), for the engine and for the bare loop, in ms and as a share of step time. Last line: JSON summary.

    python benchmarks/engine_overhead.py [--model embedded|PATH] [--batch-sizes 8,16] [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from stepserve import Engine, SamplingParams
from stepserve import sampling
from stepserve.engine.loading import load_executor

from common import pick_model


class ForwardTimer:
    """Wraps the pipeline's UNet forward and accumulates the time spent inside it."""

    def __init__(self, pipeline) -> None:
        self.total = 0.0
        self._inner = pipeline.unet_forward
        pipeline.unet_forward = self

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self._inner(*args)
        self.total += time.perf_counter() - t0
        return out

    def take(self) -> float:
        value, self.total = self.total, 0.0
        return value


def requests_for(n: int, steps: int, info) -> list[SamplingParams]:
    return [SamplingParams(prompt=f"a handwritten {i % 10}", seed=i, num_inference_steps=steps,
                           guidance_scale=info.default_guidance_scale, sampler=info.default_sampler)
            for i in range(n)]


@torch.no_grad()
def bare_loop(executor, params: list[SamplingParams], batch: int, timer: ForwardTimer) -> tuple[float, float]:
    """Returns (wall seconds, mean host seconds per denoising step outside the UNet forward)."""
    p = executor.pipeline
    info = executor.model_info
    h, w = info.default_height, info.default_width
    step_times = []
    start = time.perf_counter()
    for lo in range(0, len(params), batch):
        chunk = params[lo : lo + batch]
        cond = torch.stack(p.encode_prompts([c.prompt for c in chunk]))
        uncond = torch.stack(p.encode_prompts([""] * len(chunk)))
        embeds = torch.cat([cond, uncond])
        gens = [torch.Generator("cpu").manual_seed(c.seed) for c in chunk]
        schedule = sampling.build_schedule(chunk[0].sampler, p.scheduler_config, chunk[0].num_inference_steps)
        latents = torch.cat([torch.randn(p.latent_shape(h, w), generator=g) for g in gens])
        latents = latents * sampling.init_noise_sigma(schedule)
        states = [sampling.new_state(schedule, g) for g in gens]
        g_scale = chunk[0].guidance_scale
        for i in range(chunk[0].num_inference_steps):
            t0 = time.perf_counter()
            timer.take()
            steps = [i] * len(chunk)
            x_in, t = sampling.model_inputs(latents, states, steps)
            out = p.unet_forward(torch.cat([x_in, x_in]), torch.cat([t, t]), embeds)
            c, u = out.chunk(2)
            latents = sampling.sampler_step(u + g_scale * (c - u), latents, states, steps)
            step_times.append(time.perf_counter() - t0 - timer.take())
        p.decode(latents)
    return time.perf_counter() - start, statistics.mean(step_times)


def engine_run(executor, params: list[SamplingParams], batch: int, timer: ForwardTimer) -> tuple[float, float, float]:
    """Returns (wall seconds, mean host seconds per pure denoising step outside the forward, mean step seconds)."""
    engine = Engine(executor, strategy="continuous", max_batch_size=batch)
    step_walls: list[float] = []
    step_hosts: list[float] = []
    core = engine.core
    original = core.step

    def timed_step(now):
        timer.take()
        t0 = time.perf_counter()
        report = original(now)
        wall = time.perf_counter() - t0
        if report.batch_size and not report.admitted and not report.finished:
            step_walls.append(wall)  # pure denoising steps: comparable to the bare loop
            step_hosts.append(wall - timer.take())
        return report

    core.step = timed_step  # type: ignore[method-assign]
    start = time.perf_counter()
    results = engine.generate(params)
    wall = time.perf_counter() - start
    assert all(r.ok for r in results)
    return wall, statistics.mean(step_hosts), statistics.mean(step_walls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="auto", help="embedded | PATH | auto (embedded if installed, else tiny)")
    ap.add_argument("--batch-sizes", default="8,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", type=int, default=4, help="batches of work per measurement (N = batches x B)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = pick_model(args.model)
    executor = load_executor(model)
    timer = ForwardTimer(executor.pipeline)
    summary = {"model": executor.model_info.name, "steps": args.steps, "threads": args.threads, "results": []}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        params = requests_for(batch * args.batches, args.steps, executor.model_info)
        bare_loop(executor, params[:batch], batch, timer)  # warm-up
        engine_run(executor, params[:batch], batch, timer)
        ratios, bare_ips, eng_ips, overheads, bare_host, step_ms = [], [], [], [], [], []
        for _ in range(args.repeats):  # interleaved, so both sides see the same machine noise
            b_wall, b_host = bare_loop(executor, params, batch, timer)
            e_wall, e_host, e_step = engine_run(executor, params, batch, timer)
            bare_ips.append(len(params) / b_wall)
            eng_ips.append(len(params) / e_wall)
            ratios.append(b_wall / e_wall)
            overheads.append(e_host)
            bare_host.append(b_host)
            step_ms.append(e_step)
        row = {
            "max_batch_size": batch,
            "images": len(params),
            "bare_images_per_s": round(statistics.median(bare_ips), 3),
            "engine_images_per_s": round(statistics.median(eng_ips), 3),
            "ratio_engine_over_bare": round(statistics.median(ratios), 4),
            "ratio_min": round(min(ratios), 4),
            "ratio_max": round(max(ratios), 4),
            "host_overhead_ms_per_step": round(1000 * statistics.median(overheads), 3),
            "bare_host_ms_per_step": round(1000 * statistics.median(bare_host), 3),
            "engine_step_ms": round(1000 * statistics.median(step_ms), 3),
            "overhead_share_of_step": round(statistics.median(overheads) / statistics.median(step_ms), 4),
        }
        summary["results"].append(row)
        print(f"B={batch}: bare {row['bare_images_per_s']} img/s, engine {row['engine_images_per_s']} img/s, "
              f"ratio {row['ratio_engine_over_bare']} (min {row['ratio_min']}, max {row['ratio_max']}), "
              f"engine host time {row['host_overhead_ms_per_step']} ms/step "
              f"({100 * row['overhead_share_of_step']:.1f}% of {row['engine_step_ms']} ms; "
              f"bare loop {row['bare_host_ms_per_step']} ms)", flush=True)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
