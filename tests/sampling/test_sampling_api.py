"""Validation, caching, state handling and dtype behaviour of stepserve.sampling."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler
from sampling_reference import SHAPE, fake_model

import stepserve.sampling as S

SD = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
          steps_offset=1, timestep_spacing="leading", prediction_type="epsilon", clip_sample=False,
          set_alpha_to_one=False)


def test_public_names():
    assert set(S.__all__) >= {"SAMPLER_NAMES", "build_schedule", "new_state", "init_noise_sigma", "model_inputs",
                              "sampler_step", "predicted_original", "flow_shift_mu", "uses_dynamic_shifting",
                              "is_flow_config", "flow_dpmpp_config", "reference_scheduler"}
    assert all(hasattr(S, name) for name in S.__all__)
    assert S.SAMPLER_NAMES == ("ddim", "euler", "euler_a", "dpmpp_2m", "flow_euler")
    from stepserve.request import types

    assert tuple(types.SAMPLER_NAMES) == S.SAMPLER_NAMES


def test_unknown_sampler_names_field_and_choices():
    with pytest.raises(ValueError) as e:
        S.build_schedule("heun", SD, 10)
    msg = str(e.value)
    assert "sampler" in msg and "heun" in msg and all(n in msg for n in S.SAMPLER_NAMES)


@pytest.mark.parametrize("steps", [0, -3, 2.5, "10", True, None, 1001])
def test_bad_num_steps(steps):
    with pytest.raises(ValueError, match="num_steps"):
        S.build_schedule("euler", SD, steps)


@pytest.mark.parametrize(
    "sampler, patch, field",
    [
        ("euler_a", {"prediction_type": "sample"}, "prediction_type"),
        ("ddim", {"prediction_type": "flow_prediction"}, "prediction_type"),
        ("euler", {"timestep_spacing": "sometimes"}, "timestep_spacing"),
        ("ddim", {"beta_schedule": "quadratic"}, "beta_schedule"),
        ("dpmpp_2m", {"variance_type": "learned_range"}, "variance_type"),
        ("flow_euler", {"use_dynamic_shifting": True}, "use_dynamic_shifting"),
    ],
)
def test_unsupported_options_name_the_field(sampler, patch, field):
    with pytest.raises(ValueError) as e:
        S.build_schedule(sampler, {**SD, **patch}, 10)
    assert field in str(e.value)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_tables_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        S.build_schedule("flow_euler", {"shift_terminal": 0.1}, 1)


def test_not_a_mapping():
    with pytest.raises(ValueError, match="scheduler_config"):
        S.build_schedule("ddim", [("a", 1)], 4)


def test_cached_and_accepts_diffusers_config_objects():
    cfg = DDIMScheduler(**SD).config  # FrozenDict with _class_name / _use_default_values bookkeeping
    a = S.build_schedule("euler", cfg, 12)
    assert S.build_schedule("euler", dict(cfg), 12) is a
    ref = EulerDiscreteScheduler.from_config(cfg)
    ref.set_timesteps(12)
    assert a.timesteps == tuple(ref.timesteps.tolist())
    assert a.init_noise_sigma == pytest.approx(float(ref.init_noise_sigma), rel=0, abs=0)
    with pytest.raises(Exception):
        a.num_steps = 3  # frozen


def test_dpmpp_overrides_solver_settings():
    cfg = {**SD, "solver_order": 3, "algorithm_type": "sde-dpmsolver++", "solver_type": "heun"}
    sch = S.build_schedule("dpmpp_2m", cfg, 20)
    assert sch.orders[0] == 1 and set(sch.orders[1:-1]) == {2} and sch.orders[-1] == 1


def test_noise_samplers_need_a_generator():
    with pytest.raises(ValueError, match="generator"):
        S.new_state(S.build_schedule("euler_a", SD, 5), None)
    S.new_state(S.build_schedule("euler", SD, 5), None)  # deterministic: fine


def _batch(samplers, steps):
    states = [S.new_state(S.build_schedule(s, SD, 10), torch.Generator().manual_seed(i))
              for i, s in enumerate(samplers)]
    x = torch.randn((len(samplers),) + SHAPE, generator=torch.Generator().manual_seed(99))
    return x, states, list(steps)


def test_step_range_and_batch_shape_checked():
    x, states, steps = _batch(["euler", "ddim"], [0, 10])
    with pytest.raises(ValueError, match="steps"):
        S.model_inputs(x, states, steps)
    with pytest.raises(ValueError, match="steps"):
        S.sampler_step(x, x, states, [0, -1])
    with pytest.raises(ValueError):
        S.sampler_step(x, x, states[:1], [0])


def test_dpmpp_needs_previous_step_and_allows_retry():
    x, states, _ = _batch(["dpmpp_2m"], [0])
    with pytest.raises(RuntimeError, match="in order"):
        S.sampler_step(x, x, states, [3])
    x1 = S.sampler_step(fake_model(x, torch.tensor([999.0]), torch.zeros(1)), x, states, [0])
    out = fake_model(x1, torch.tensor([899.0]), torch.zeros(1))
    first = S.sampler_step(out, x1, states, [1])
    again = S.sampler_step(out, x1, states, [1])  # e.g. the engine retries a failed iteration
    assert torch.equal(first, again)
    assert sorted(states[0].history) == [0, 1]


def test_predicted_original_leaves_state_alone():
    x, states, steps = _batch(["dpmpp_2m", "euler_a"], [0, 0])
    g_state = states[1].generator.get_state()
    S.predicted_original(x, x, states, steps)
    assert states[0].history == {} and torch.equal(states[1].generator.get_state(), g_state)


@pytest.mark.parametrize("sampler", S.SAMPLER_NAMES)
def test_half_precision_keeps_dtype_and_tracks_float32(sampler):
    x, states, steps = _batch([sampler, sampler], [0, 0])
    x32 = x
    states16 = [S.new_state(st.schedule, torch.Generator().manual_seed(i)) for i, st in enumerate(states)]
    for _ in range(4):
        inp, ts = S.model_inputs(x32, states, steps)
        x32 = S.sampler_step(fake_model(inp, ts, torch.zeros(2)), x32, states, steps)
        steps = [s + 1 for s in steps]
    x16, steps = x.half(), [0, 0]
    for _ in range(4):
        inp, ts = S.model_inputs(x16, states16, steps)
        assert inp.dtype == torch.float16
        x16 = S.sampler_step(fake_model(inp.float(), ts, torch.zeros(2)).half(), x16, states16, steps)
        assert x16.dtype == torch.float16
        steps = [s + 1 for s in steps]
    scale = x32.abs().max().item() + 1.0
    assert (x16.float() - x32).abs().max().item() <= 2e-2 * scale
