"""Helpers for the sampler tests: a deterministic fake denoiser, diffusers reference runs, and a tiny step-level
batching loop that drives stepserve.sampling the way the engine does."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import diffusers
import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor
from tiny_sd import SCHEDULER_CLASS as CLASSES

import stepserve.sampling as S

OVERRIDES = {"dpmpp_2m": dict(solver_order=2, algorithm_type="dpmsolver++", solver_type="midpoint")}
SHAPE = (4, 8, 8)


def fake_model(x: torch.Tensor, t: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A smooth, input- and time-dependent stand-in for a denoiser; row k uses its own t[k] and key[k]."""
    t = t.to(torch.float32).reshape(-1, *([1] * (x.ndim - 1)))
    key = key.to(torch.float32).reshape(-1, *([1] * (x.ndim - 1)))
    return 0.9 * x * (t / (t + 1000.0)) + 0.1 * torch.sin(1.3 * x + t / 97.0 + key)


def make_scheduler(sampler: str, config: dict, num_steps: int, mu: float | None = None, sigmas: str | None = None):
    """The diffusers scheduler, set up as the pipeline would: FluxPipeline passes ``sigmas=np.linspace(1, 1/n, n)``
    (dropped when the scheduler has use_flow_sigmas) and ``mu``; StableDiffusion3Pipeline passes ``mu`` only."""
    if sampler == "dpmpp_2m" and "shift" in config:
        # A flow model (FlowMatchEulerDiscreteScheduler config) with DPM-Solver++(2M) in flow mode, written out here
        # independently of stepserve's flow_dpmpp_config.
        sched = diffusers.DPMSolverMultistepScheduler(
            num_train_timesteps=config.get("num_train_timesteps", 1000), use_flow_sigmas=True,
            flow_shift=config.get("shift", 1.0), prediction_type="flow_prediction",
            use_dynamic_shifting=config.get("use_dynamic_shifting", False), **OVERRIDES["dpmpp_2m"])
    else:
        cls = getattr(diffusers, CLASSES[sampler])
        sched = cls.from_config(config, **OVERRIDES.get(sampler, {}))
    kwargs = {} if mu is None else {"mu": mu}
    if sigmas == "linspace" and not sched.config.get("use_flow_sigmas"):
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), **kwargs)
    else:
        sched.set_timesteps(num_steps, **kwargs)
    return sched


@dataclass
class Trajectory:
    latents: list = field(default_factory=list)  # x_0 (initial), x_1, ... x_n
    inputs: list = field(default_factory=list)  # model input at each step
    timesteps: list = field(default_factory=list)
    denoised: list = field(default_factory=list)  # diffusers' x0 estimate at each step, where it exposes one


def reference(sampler: str, config: dict, num_steps: int, seed: int, key: float, mu: float | None = None,
              sigmas: str | None = None) -> Trajectory:
    """Run the diffusers scheduler for one image exactly as a diffusers pipeline does."""
    sched = make_scheduler(sampler, config, num_steps, mu, sigmas)
    ts = sched.timesteps.tolist()
    if ts.count(ts[0]) > 1:
        # A repeated first timestep (dpmpp_2m with karras-like sigmas from a huge sigma_max, e.g. zero-terminal-SNR
        # or cosine betas) makes diffusers look its first step up at index 1; it then runs off its sigma table on
        # the last step. Pin the start at 0, as diffusers' img2img pipelines do, to compare the step math.
        sched.set_begin_index(0)
    gen = torch.Generator("cpu").manual_seed(seed)
    x = randn_tensor((1,) + SHAPE, generator=gen, dtype=torch.float32)
    x = x * getattr(sched, "init_noise_sigma", 1.0)
    params = inspect.signature(sched.step).parameters
    extra = {k: v for k, v in (("eta", 0.0), ("generator", gen)) if k in params}
    traj = Trajectory(latents=[x])
    for t in sched.timesteps:
        inp = sched.scale_model_input(x, t) if hasattr(sched, "scale_model_input") else x
        out = fake_model(inp, t.reshape(1), torch.tensor([key]))
        if sampler == "dpmpp_2m":
            if sched.step_index is None:
                sched._init_step_index(t)
            traj.denoised.append(sched.convert_model_output(out, sample=x))
        elif sampler == "flow_euler":
            if sched.step_index is None:
                sched._init_step_index(t)
            traj.denoised.append(x.float() - sched.sigmas[sched.step_index] * out)
        res = sched.step(out, t, x, **extra)
        if sampler in ("ddim", "euler", "euler_a"):
            traj.denoised.append(res.pred_original_sample)
        x = res.prev_sample
        traj.inputs.append(inp)
        traj.timesteps.append(float(t))
        traj.latents.append(x)
    return traj


@dataclass
class Item:
    sampler: str
    config: dict
    num_steps: int
    join: int  # engine iteration at which the request is admitted
    seed: int
    key: float
    mu: float | None = None  # resolution-dependent shift (flow configs with use_dynamic_shifting)
    sigmas: str | None = None  # "linspace": the pipeline passes explicit sigmas, as FluxPipeline does


def run_batched(items: list[Item], order_seed: int = 0) -> tuple[float, int]:
    """Drive all items through one shared step loop (joining at different iterations, rows shuffled every
    iteration) and compare every row against its solo diffusers run. Returns (max abs diff, compared steps)."""
    refs = [reference(it.sampler, it.config, it.num_steps, it.seed, it.key, it.mu, it.sigmas) for it in items]
    shuffle = torch.Generator().manual_seed(order_seed)
    live: dict[int, dict] = {}
    worst, compared, iteration = 0.0, 0, 0
    pending = sorted(range(len(items)), key=lambda k: items[k].join)
    while pending or live:
        while pending and items[pending[0]].join <= iteration:
            k = pending.pop(0)
            it = items[k]
            sch = S.build_schedule(it.sampler, it.config, it.num_steps, mu=it.mu, sigmas=it.sigmas)
            assert sch.num_steps == len(refs[k].timesteps)
            gen = torch.Generator("cpu").manual_seed(it.seed)
            x = torch.randn((1,) + SHAPE, generator=gen, dtype=torch.float32) * S.init_noise_sigma(sch)
            worst = max(worst, _diff(x, refs[k].latents[0]))
            live[k] = dict(state=S.new_state(sch, gen), x=x, step=0)
        iteration += 1
        if not live:
            continue
        rows = list(live)
        rows = [rows[j] for j in torch.randperm(len(rows), generator=shuffle).tolist()]
        latents = torch.cat([live[k]["x"] for k in rows])
        states = [live[k]["state"] for k in rows]
        steps = [live[k]["step"] for k in rows]
        inputs, ts = S.model_inputs(latents, states, steps)
        assert ts.shape == (len(rows),) and ts.dtype == torch.float32
        out = fake_model(inputs, ts, torch.tensor([items[k].key for k in rows]))
        x0 = S.predicted_original(out, latents, states, steps)
        new = S.sampler_step(out, latents, states, steps)
        assert new.shape == latents.shape and new.dtype == latents.dtype
        for r, k in enumerate(rows):
            i, ref = steps[r], refs[k]
            assert ts[r].item() == torch.tensor(ref.timesteps[i], dtype=torch.float32).item()
            worst = max(worst, _diff(inputs[r : r + 1], ref.inputs[i]))
            worst = max(worst, _diff(new[r : r + 1], ref.latents[i + 1]))
            if ref.denoised:
                worst = max(worst, _diff(x0[r : r + 1], ref.denoised[i]))
            compared += 1
            live[k]["x"] = new[r : r + 1]
            live[k]["step"] = i + 1
            if i + 1 == items[k].num_steps:
                del live[k]
    return worst, compared


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    d = (a.double() - b.double()).abs()
    both_nan = torch.isnan(a) & torch.isnan(b)
    assert not torch.isnan(d[~both_nan]).any(), "NaN in one trajectory only"
    return float(d[~both_nan].max()) if (~both_nan).any() else 0.0
