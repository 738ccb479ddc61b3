"""DPM-Solver++(2M) on a flow model (sampler "dpmpp_2m" with an SD3 / Flux FlowMatchEulerDiscreteScheduler config):
the same tables and steps as diffusers' DPMSolverMultistepScheduler in flow mode, row by row in mixed batches."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from sampling_reference import Item, run_batched

import stepserve.sampling as S


def _saved_config(**kwargs) -> dict:
    cfg = FlowMatchEulerDiscreteScheduler(**kwargs).config
    return {"_class_name": "FlowMatchEulerDiscreteScheduler", **{k: v for k, v in cfg.items() if k[0] != "_"}}


SD3 = _saved_config(shift=3.0)
FLUX = _saved_config(shift=3.0, use_dynamic_shifting=True, base_shift=0.4, max_shift=1.3)  # non-default line


def _hand_built(cfg: dict) -> DPMSolverMultistepScheduler:
    """DPM-Solver++(2M) in flow mode, written out from diffusers' documentation of the flow options."""
    return DPMSolverMultistepScheduler(
        num_train_timesteps=1000, use_flow_sigmas=True, flow_shift=cfg["shift"], prediction_type="flow_prediction",
        use_dynamic_shifting=cfg["use_dynamic_shifting"], solver_order=2, algorithm_type="dpmsolver++",
        solver_type="midpoint",
    )


@pytest.mark.parametrize("cfg", [SD3, FLUX, {k: v for k, v in SD3.items() if k != "_class_name"}])
def test_reference_scheduler_is_dpm_in_flow_mode(cfg):
    assert S.is_flow_config(cfg)
    ref = S.reference_scheduler("dpmpp_2m", cfg)
    want = _hand_built(cfg).config
    assert isinstance(ref, DPMSolverMultistepScheduler)
    assert {k: ref.config[k] for k in want if k[0] != "_"} == {k: v for k, v in want.items() if k[0] != "_"}
    assert S.flow_dpmpp_config(cfg)["flow_shift"] == 3.0


@pytest.mark.parametrize("seq", [16, 1024, 4096])
@pytest.mark.parametrize("n", [1, 4, 28])
def test_flux_pipeline_timesteps_with_the_reference_scheduler(seq, n):
    """FluxPipeline.__call__ step 5 with pipe.scheduler = reference_scheduler(...): it drops its linspace sigmas for
    a use_flow_sigmas scheduler and computes mu from scheduler.config, which carries the model's shift line."""
    sched = S.reference_scheduler("dpmpp_2m", FLUX)
    sigmas = np.linspace(1.0, 1 / n, n)
    if hasattr(sched.config, "use_flow_sigmas") and sched.config.use_flow_sigmas:
        sigmas = None
    mu = calculate_shift(seq, sched.config.get("base_image_seq_len", 256), sched.config.get("max_image_seq_len", 4096),
                         sched.config.get("base_shift", 0.5), sched.config.get("max_shift", 1.15))
    assert mu == S.flow_shift_mu(seq, FLUX)
    timesteps, _ = retrieve_timesteps(sched, n, "cpu", sigmas=sigmas, mu=mu)
    ours = S.build_schedule("dpmpp_2m", FLUX, n, mu=mu, sigmas="linspace")
    assert ours.timesteps == tuple(float(t) for t in timesteps.tolist())
    assert ours.sigmas == tuple(sched.sigmas.tolist())
    assert S.build_schedule("dpmpp_2m", FLUX, n, mu=mu).sigmas == ours.sigmas  # the linspace is dropped either way


@pytest.mark.parametrize("n", [1, 2, 3, 14, 15, 28])
def test_tables_match_hand_built_scheduler(n):
    for cfg, mu in [(SD3, None), (FLUX, 0.45), (FLUX, 1.2)]:
        ref = _hand_built(cfg)
        ref.set_timesteps(n, **({} if mu is None else {"mu": mu}))
        sch = S.build_schedule("dpmpp_2m", cfg, n, mu=mu)
        assert sch.timesteps == tuple(float(t) for t in ref.timesteps.tolist())
        assert sch.sigmas == tuple(ref.sigmas.tolist())
        assert sch.flow_sigmas and sch.prediction_type == "flow_prediction" and sch.init_noise_sigma == 1.0
        assert sch.orders[0] == 1 and sch.orders[-1] == 1 and set(sch.orders[1:-1]) <= {2}


def test_mixed_rows_match_diffusers_step_by_step():
    """SD3-style and Flux-style dpmpp_2m rows (several lengths and mu, around the lower-order switch at 15 steps) and
    flow_euler rows in shared, shuffled, staggered batches: each row equals its diffusers scheduler run alone."""
    mus = [S.flow_shift_mu(seq, FLUX) for seq in (16, 256, 1024, 4096)]
    batch = [
        Item("dpmpp_2m", SD3, 1, join=0, seed=1, key=0.2),
        Item("dpmpp_2m", SD3, 15, join=0, seed=2, key=-0.4),
        Item("dpmpp_2m", FLUX, 14, join=1, seed=3, key=0.9, mu=mus[0], sigmas="linspace"),
        Item("dpmpp_2m", FLUX, 4, join=2, seed=4, key=1.5, mu=mus[3], sigmas="linspace"),
        Item("dpmpp_2m", FLUX, 9, join=2, seed=5, key=-2.0, mu=mus[1]),
        Item("flow_euler", FLUX, 6, join=0, seed=6, key=0.0, mu=mus[2], sigmas="linspace"),
        Item("flow_euler", SD3, 3, join=4, seed=7, key=0.7),
        Item("dpmpp_2m", {**SD3, "shift": 1.0}, 20, join=3, seed=8, key=2.5),
    ]
    for order_seed in (0, 1):
        worst, compared = run_batched(batch, order_seed=order_seed)
        assert compared == sum(it.num_steps for it in batch)
        assert worst <= 1e-5, worst


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"shift_terminal": 0.1}, "shift_terminal"),
        ({"use_karras_sigmas": True}, "use_karras_sigmas"),
        ({"invert_sigmas": True}, "invert_sigmas"),
        ({"use_dynamic_shifting": True, "time_shift_type": "linear"}, "time_shift_type"),
    ],
)
def test_options_dpm_flow_mode_cannot_reproduce_are_named(patch, field):
    with pytest.raises(ValueError, match=field) as e:
        S.build_schedule("dpmpp_2m", {**SD3, **patch}, 10, mu=0.5 if patch.get("use_dynamic_shifting") else None)
    assert "flow_euler" in str(e.value) or "exponential" in str(e.value)


@pytest.mark.parametrize("sampler", ["ddim", "euler", "euler_a"])
def test_noise_prediction_samplers_refuse_a_flow_model(sampler):
    with pytest.raises(ValueError, match=r"sampler must be one of \('flow_euler', 'dpmpp_2m'\)"):
        S.build_schedule(sampler, SD3, 10)


def test_mu_rules_follow_use_dynamic_shifting():
    with pytest.raises(ValueError, match="mu is required"):
        S.build_schedule("dpmpp_2m", FLUX, 10)
    with pytest.raises(ValueError, match="mu must be None"):
        S.build_schedule("dpmpp_2m", SD3, 10, mu=0.7)


def test_sd_config_dpmpp_is_unchanged():
    """A noise-prediction model's config still gives the plain DPM-Solver++(2M) tables."""
    sd = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1)
    assert not S.is_flow_config(sd) and not S.is_flow_config({"_class_name": "PNDMScheduler", "shift": 2})
    assert S.is_flow_config({"_class_name": "FlowMatchHeunDiscreteScheduler"})
    sch = S.build_schedule("dpmpp_2m", sd, 10)
    assert not sch.flow_sigmas and sch.prediction_type == "epsilon"
