"""Every sampler, stepped per row inside mixed, staggered batches, matches its diffusers scheduler run alone."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sampling_reference import Item, run_batched

import stepserve.sampling as S

TOL = 1e-5
SD_BETAS = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
LINEAR_BETAS = dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02)


@st.composite
def configs(draw, sampler: str) -> dict:
    if sampler == "flow_euler":
        cfg = dict(num_train_timesteps=1000, shift=draw(st.sampled_from([1.0, 3.0, 0.5])))
        cfg["stochastic_sampling"] = draw(st.booleans())
        extra = draw(st.sampled_from(["none", "karras", "invert", "terminal", "sd_config", "dynamic"]))
        if extra == "dynamic":  # resolution-dependent shift (Flux): the item draws a mu
            cfg["use_dynamic_shifting"] = True
            cfg["time_shift_type"] = draw(st.sampled_from(["exponential", "linear"]))
        elif extra == "karras":
            cfg["use_karras_sigmas"] = True
        elif extra == "invert":
            cfg["invert_sigmas"] = True
        elif extra == "terminal":
            cfg["shift_terminal"] = 0.1
        elif extra == "sd_config":  # an SD-style config handed to the flow scheduler: unknown keys are ignored
            cfg = dict(SD_BETAS, steps_offset=1, clip_sample=False, set_alpha_to_one=False, stochastic_sampling=False)
        return cfg
    if sampler == "dpmpp_2m" and draw(st.integers(0, 4)) == 0:  # a flow model's config: DPM-Solver++ in flow mode
        return dict(num_train_timesteps=1000, shift=draw(st.sampled_from([1.0, 3.0])),
                    use_dynamic_shifting=draw(st.booleans()))
    cfg = dict(draw(st.sampled_from([SD_BETAS, LINEAR_BETAS, {"beta_schedule": "squaredcos_cap_v2"}])))
    cfg["num_train_timesteps"] = 1000
    cfg["timestep_spacing"] = draw(st.sampled_from(["leading", "trailing", "linspace"]))
    cfg["steps_offset"] = draw(st.sampled_from([0, 1]))
    preds = {
        "ddim": ["epsilon", "v_prediction", "sample"],
        "euler": ["epsilon", "v_prediction", "sample"],
        "euler_a": ["epsilon", "v_prediction"],
        "dpmpp_2m": ["epsilon", "v_prediction", "sample"],
    }[sampler]
    cfg["prediction_type"] = draw(st.sampled_from(preds))
    if cfg["prediction_type"] == "v_prediction" and cfg["timestep_spacing"] == "trailing":
        cfg["rescale_betas_zero_snr"] = draw(st.booleans())
    if sampler == "ddim":
        cfg["set_alpha_to_one"] = draw(st.booleans())
        clip = draw(st.sampled_from(["none", "clip", "threshold"]))
        cfg["clip_sample"] = clip == "clip"
        cfg["clip_sample_range"] = draw(st.sampled_from([1.0, 0.5]))
        if clip == "threshold":
            cfg.update(thresholding=True, dynamic_thresholding_ratio=0.9, sample_max_value=1.5)
    if sampler in ("euler", "dpmpp_2m"):
        extra = ["lu", "flow"] if sampler == "dpmpp_2m" else []
        sig = draw(st.sampled_from(["plain", "karras", "exponential"] + extra))
        cfg.update({"karras": {"use_karras_sigmas": True}, "exponential": {"use_exponential_sigmas": True},
                    "lu": {"use_lu_lambdas": True}, "plain": {}, "flow": {"use_flow_sigmas": True}}[sig])
        if sig == "flow":  # rectified-flow noise levels, as for SANA / Wan
            cfg["flow_shift"] = draw(st.sampled_from([1.0, 3.0]))
            cfg["prediction_type"] = draw(st.sampled_from(["flow_prediction", "epsilon"]))
        cfg["final_sigmas_type"] = draw(st.sampled_from(["zero", "sigma_min"]))
    if sampler == "euler":
        cfg["interpolation_type"] = draw(st.sampled_from(["linear", "log_linear"]))
        if cfg["prediction_type"] == "v_prediction":
            cfg["timestep_type"] = draw(st.sampled_from(["discrete", "continuous"]))
    if sampler == "dpmpp_2m":
        cfg["lower_order_final"] = draw(st.booleans())
        cfg["euler_at_final"] = draw(st.booleans())
        if draw(st.booleans()) and cfg["prediction_type"] != "sample":
            cfg.update(thresholding=True, dynamic_thresholding_ratio=0.9, sample_max_value=2.0)
    return cfg


@st.composite
def items(draw, samplers=S.SAMPLER_NAMES) -> Item:
    sampler = draw(st.sampled_from(samplers))
    config = draw(configs(sampler))
    # shift_terminal stretches a one-step schedule by 0/0: diffusers' own tables are NaN there
    low = 2 if config.get("shift_terminal") else 1
    dynamic = config.get("use_dynamic_shifting")
    return Item(
        sampler=sampler,
        config=config,
        num_steps=draw(st.integers(low, 50)),
        join=draw(st.integers(0, 12)),
        seed=draw(st.integers(0, 2**31 - 1)),
        key=draw(st.floats(-3, 3, allow_nan=False)),
        mu=draw(st.floats(0.3, 1.5)) if dynamic else None,
        sigmas=draw(st.sampled_from([None, "linspace"])) if "shift" in config else None,
    )


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(items(), min_size=1, max_size=5), st.integers(0, 1000))
def test_mixed_batches_match_diffusers(batch, order_seed):
    worst, compared = run_batched(batch, order_seed)
    assert compared == sum(it.num_steps for it in batch)
    assert worst <= TOL, worst


@pytest.mark.parametrize("sampler", S.SAMPLER_NAMES)
@settings(max_examples=4, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_single_sampler_batches_match_diffusers(sampler, data):
    batch = data.draw(st.lists(items(samplers=(sampler,)), min_size=2, max_size=4))
    worst, _ = run_batched(batch, order_seed=1)
    assert worst <= TOL, worst


@pytest.mark.parametrize("sampler", S.SAMPLER_NAMES)
@pytest.mark.parametrize("num_steps", [1, 2, 3, 14, 15, 25])
def test_sd_defaults_every_length(sampler, num_steps):
    """The configs SD 1.x ships, every sampler, lengths around the dpmpp final-order switch (15)."""
    cfg = dict(SD_BETAS, num_train_timesteps=1000, steps_offset=1, clip_sample=False, set_alpha_to_one=False,
               timestep_spacing="leading", prediction_type="epsilon")
    batch = [Item(sampler, cfg, num_steps, join=0, seed=7, key=0.5),
             Item(sampler, cfg, num_steps, join=2, seed=8, key=-1.0)]
    worst, compared = run_batched(batch)
    assert compared == 2 * num_steps
    assert worst <= TOL, worst
