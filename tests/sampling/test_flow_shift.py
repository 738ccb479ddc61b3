"""Resolution-dependent flow shift: ``flow_shift_mu`` is diffusers' calculate_shift, ``build_schedule(..., mu=,
sigmas=)`` gives FlowMatchEulerDiscreteScheduler's tables as FluxPipeline / StableDiffusion3Pipeline set them, and
rows with different mu step together exactly as each does alone."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_calculate_shift
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift as sd3_calculate_shift
from sampling_reference import Item, run_batched

import stepserve.sampling as S


def _saved_config(**kwargs) -> dict:
    """A FlowMatchEulerDiscreteScheduler config as scheduler_config.json holds it (no ``_use_default_values``
    bookkeeping, which would make diffusers ignore a patched key)."""
    cfg = FlowMatchEulerDiscreteScheduler(**kwargs).config
    return {"_class_name": "FlowMatchEulerDiscreteScheduler", **{k: v for k, v in cfg.items() if k[0] != "_"}}


# Flux.1-dev's scheduler config; schnell's is the same with use_dynamic_shifting False.
FLUX = _saved_config(shift=3.0, use_dynamic_shifting=True)
FLUX_SCHNELL = dict(FLUX, use_dynamic_shifting=False, shift=1.0)
SD3 = _saved_config(shift=3.0)
SEQ_LENS = [1, 16, 256, 1000, 4096, 6400]


@pytest.mark.parametrize("seq", SEQ_LENS)
@pytest.mark.parametrize("cfg", [FLUX, dict(base_shift=0.3, max_shift=1.5, base_image_seq_len=64,
                                            max_image_seq_len=1024), {}])
def test_mu_is_diffusers_calculate_shift(seq, cfg):
    args = [cfg.get(k, d) for k, d in (("base_image_seq_len", 256), ("max_image_seq_len", 4096),
                                        ("base_shift", 0.5), ("max_shift", 1.15))]
    mu = S.flow_shift_mu(seq, cfg)
    assert mu == flux_calculate_shift(seq, *args)  # same float operations: bit-identical
    assert mu == sd3_calculate_shift(seq, *args)
    assert S.flow_shift_mu(np.int64(seq), cfg) == mu  # e.g. a product of tensor shapes turned to numpy


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "256", None])
def test_mu_rejects_bad_seq_len(bad):
    with pytest.raises(ValueError, match="image_seq_len must be a positive integer"):
        S.flow_shift_mu(bad, FLUX)


@pytest.mark.parametrize("patch", [{"base_shift": None}, {"max_shift": "1.15"}, {"max_image_seq_len": 256}])
def test_mu_rejects_bad_config(patch):
    with pytest.raises(ValueError, match="base_shift|max_shift|max_image_seq_len"):
        S.flow_shift_mu(64, {**FLUX, **patch})


def _diffusers_tables(cfg, n, mu, sigmas):
    ref = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    kwargs = {} if mu is None else {"mu": mu}
    if sigmas == "linspace":  # FluxPipeline.__call__ step 5, through retrieve_timesteps
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), **kwargs)
    else:  # StableDiffusion3Pipeline
        ref.set_timesteps(n, **kwargs)
    return tuple(ref.timesteps.tolist()), tuple(ref.sigmas.tolist())


FLOW_VARIANTS = {
    "exponential": {},
    "linear": {"time_shift_type": "linear"},
    "terminal": {"shift_terminal": 0.05},
    "inverted": {"invert_sigmas": True},
    "karras": {"use_karras_sigmas": True},
}


@pytest.mark.parametrize("variant", FLOW_VARIANTS)
@pytest.mark.parametrize("sigmas", [None, "linspace"])
@pytest.mark.parametrize("n", [2, 4, 13, 28])
def test_dynamic_schedule_tables_match_diffusers(variant, sigmas, n):
    cfg = {**FLUX, **FLOW_VARIANTS[variant]}
    for seq in (16, 1024, 4096):
        mu = S.flow_shift_mu(seq, cfg)
        sch = S.build_schedule("flow_euler", cfg, n, mu=mu, sigmas=sigmas)
        timesteps, sig = _diffusers_tables(cfg, n, mu, sigmas)
        assert (sch.timesteps, sch.sigmas) == (timesteps, sig)  # exact: the tables are diffusers' own
        assert sch.mu == mu and sch.num_steps == n


def test_one_step_flux_schedule():
    mu = S.flow_shift_mu(4096, FLUX)
    sch = S.build_schedule("flow_euler", FLUX, 1, mu=mu, sigmas="linspace")
    assert (sch.timesteps, sch.sigmas) == _diffusers_tables(FLUX, 1, mu, "linspace")
    assert sch.sigmas[0] == 1.0  # linspace(1, 1, 1) shifted stays at pure noise


def test_fixed_shift_with_linspace_sigmas_matches_schnell():
    for n in (1, 4):
        sch = S.build_schedule("flow_euler", FLUX_SCHNELL, n, sigmas="linspace")
        assert (sch.timesteps, sch.sigmas) == _diffusers_tables(FLUX_SCHNELL, n, None, "linspace")
        assert sch.mu is None
    # the explicit sigmas are what FluxPipeline gives; they differ from the scheduler's own spacing
    assert S.build_schedule("flow_euler", FLUX_SCHNELL, 4).sigmas != sch.sigmas


def test_mu_changes_the_schedule_and_is_part_of_the_cache_key():
    a = S.build_schedule("flow_euler", FLUX, 10, mu=0.5, sigmas="linspace")
    assert S.build_schedule("flow_euler", dict(FLUX), 10, mu=0.5, sigmas="linspace") is a
    b = S.build_schedule("flow_euler", FLUX, 10, mu=1.1, sigmas="linspace")
    c = S.build_schedule("flow_euler", FLUX, 10, mu=0.5)
    assert len({a.sigmas, b.sigmas, c.sigmas}) == 3
    assert all(x > y for x, y in zip(b.sigmas[1:-1], a.sigmas[1:-1]))  # larger mu: more time at high noise
    assert a.kind == b.kind  # rows with different mu step with one formula


def test_missing_mu_names_the_fix():
    with pytest.raises(ValueError, match="mu is required.*use_dynamic_shifting.*flow_shift_mu"):
        S.build_schedule("flow_euler", FLUX, 10)
    assert S.uses_dynamic_shifting(FLUX) and not S.uses_dynamic_shifting(SD3)


@pytest.mark.parametrize("sampler, cfg", [("flow_euler", SD3), ("flow_euler", FLUX_SCHNELL)])
def test_mu_for_a_fixed_shift_is_refused(sampler, cfg):
    with pytest.raises(ValueError, match="mu must be None.*use_dynamic_shifting is off"):
        S.build_schedule(sampler, cfg, 10, mu=0.8)


def test_mu_for_a_noise_prediction_sampler_is_refused():
    sd = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    with pytest.raises(ValueError, match="mu must be None"):
        S.build_schedule("euler", sd, 10, mu=0.8)
    with pytest.raises(ValueError, match=r"sigmas must be one of \(None,\) for sampler 'ddim'"):
        S.build_schedule("ddim", sd, 10, sigmas="linspace")


@pytest.mark.parametrize("mu", [float("nan"), float("inf"), "0.5", True])
def test_bad_mu_values(mu):
    with pytest.raises(ValueError, match="mu must be a finite number"):
        S.build_schedule("flow_euler", FLUX, 10, mu=mu)


def test_unknown_sigmas_choice():
    with pytest.raises(ValueError, match=r"sigmas must be one of \(None, 'linspace'\)"):
        S.build_schedule("flow_euler", FLUX, 10, mu=0.5, sigmas="karras")


def test_unknown_time_shift_type():
    with pytest.raises(ValueError, match="time_shift_type"):
        S.build_schedule("flow_euler", {**FLUX, "time_shift_type": "cosine"}, 10, mu=0.5)


@pytest.mark.parametrize("stochastic", [False, True])
def test_mixed_mu_rows_step_like_each_alone(stochastic):
    """Requests of different sizes (different mu) and lengths, joining at different iterations, stepped in shared
    shuffled batches: every row's every step equals diffusers' FlowMatchEulerDiscreteScheduler run alone."""
    cfg = {**FLUX, "stochastic_sampling": stochastic}
    batch = [
        Item("flow_euler", cfg, n, join=j, seed=10 + k, key=0.3 * k, mu=S.flow_shift_mu(seq, cfg), sigmas="linspace")
        for k, (n, j, seq) in enumerate([(4, 0, 16), (7, 0, 4096), (7, 1, 1024), (1, 2, 256), (12, 3, 64)])
    ]
    batch.append(Item("flow_euler", {**SD3, "stochastic_sampling": stochastic}, 5, join=1, seed=3, key=-1.0))
    worst, compared = run_batched(batch, order_seed=5)
    assert compared == sum(it.num_steps for it in batch)
    assert worst <= 1e-5, worst
