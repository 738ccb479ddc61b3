"""Bad input names the field and what is allowed."""

from dataclasses import replace

import pytest

from stepserve.costs import FAKE_MODEL
from stepserve.request.types import SamplingParams
from stepserve.request.validation import SizeError, ValidationError, resolve_params


@pytest.mark.parametrize(
    "changes, field, allowed",
    [
        ({"sampler": "plms"}, "sampler", "allowed: ddim, euler, euler_a, dpmpp_2m, flow_euler"),
        ({"num_inference_steps": 0}, "num_inference_steps", "[1, 200]"),
        ({"num_inference_steps": 201}, "num_inference_steps", "[1, 200]"),
        ({"num_inference_steps": 2.5}, "num_inference_steps", "integer"),
        ({"height": 33}, "height", "multiples of 8 from 16 to 64"),
        ({"width": 1024}, "width", "multiples of 8 from 16 to 64"),
        ({"guidance_scale": -1.0}, "guidance_scale", "[0, 50]"),
        ({"guidance_scale": float("nan")}, "guidance_scale", "[0, 50]"),
        ({"prompt": ""}, "prompt", "non-empty"),
        ({"prompt": "   "}, "prompt", "non-empty"),
        ({"seed": -1}, "seed", "integer in [0, "),
        ({"seed": "abc"}, "seed", "integer in [0, "),
        ({"seed": True}, "seed", "integer in [0, "),
        ({"timeout_s": 0}, "timeout_s", "positive"),
        ({"timeout_s": float("inf")}, "timeout_s", "finite"),
        ({"timeout_s": float("nan")}, "timeout_s", "finite"),
        ({"guidance_scale": float("inf")}, "guidance_scale", "[0, 50]"),
        ({"prompt": "a \ud800 b"}, "prompt", "lone surrogate"),
        ({"negative_prompt": "\udfff"}, "negative_prompt", "lone surrogate"),
        ({"priority": 101}, "priority", "integer in [-100, 100]"),
        ({"priority": -101}, "priority", "integer in [-100, 100]"),
        ({"priority": 1.5}, "priority", "integer in [-100, 100]"),
        ({"priority": True}, "priority", "integer in [-100, 100]"),
    ],
)
def test_bad_input_names_field_and_allowed_values(changes, field, allowed):
    params = SamplingParams(prompt="seven", **{k: v for k, v in changes.items() if k != "prompt"})
    if "prompt" in changes:
        params.prompt = changes["prompt"]
    with pytest.raises(ValidationError) as info:
        resolve_params(params, FAKE_MODEL)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:") and allowed in str(info.value)


def test_defaults_fill_unset_fields_and_a_seed_is_drawn():
    p = resolve_params(SamplingParams(prompt="seven"), FAKE_MODEL)
    assert p.num_inference_steps == FAKE_MODEL.default_steps and p.sampler == FAKE_MODEL.default_sampler
    assert (p.height, p.width) == (FAKE_MODEL.default_height, FAKE_MODEL.default_width)
    assert isinstance(p.seed, int) and p.guidance_scale == FAKE_MODEL.default_guidance_scale


def test_priority_defaults_to_zero_and_keeps_a_valid_value():
    assert resolve_params(SamplingParams(prompt="seven"), FAKE_MODEL).priority == 0
    assert resolve_params(SamplingParams(prompt="seven", priority=None), FAKE_MODEL).priority == 0
    assert resolve_params(SamplingParams(prompt="seven", priority=-100), FAKE_MODEL).priority == -100


def test_a_request_is_resolved_once_where_it_enters():
    """The edge resolves (defaults filled, a seed drawn); the engine core and the offline API keep that object, so
    a drawn seed is the one that runs and nothing is checked twice."""
    from stepserve.api import Engine
    from stepserve.engine.core import EngineCore
    from stepserve.costs import FakeExecutor
    from stepserve.scheduling import make_policy
    from stepserve.request.types import ResolvedParams

    resolved = resolve_params(SamplingParams(prompt="a digit"), FAKE_MODEL)
    assert isinstance(resolved, ResolvedParams) and resolved.seed is not None
    assert resolve_params(resolved, FAKE_MODEL) is resolved
    core = EngineCore(FakeExecutor(), make_policy("continuous"))
    assert core.add_request(resolved, 0.0).params is resolved
    [result] = Engine(FakeExecutor()).generate([SamplingParams(prompt="a digit")])
    assert isinstance(result.params, ResolvedParams) and result.params.seed is not None


@pytest.mark.parametrize("height, width, says", [
    (33, 32, ("32x33 (width x height) is not supported: height 33 is not a multiple of 8; allowed: width and height "
              "multiples of 8 from 16 to 64 (default 32x32)")),
    (32, 72, "72x32 (width x height) is not supported: width 72 is outside 16..64; allowed:"),
    (64, 64.0, "64.0x64 (width x height) is not supported: width 64.0 is not an integer; allowed:"),
])
def test_a_bad_size_names_the_whole_size_asked_for(height, width, says):
    with pytest.raises(SizeError) as info:
        resolve_params(SamplingParams(prompt="seven", height=height, width=width), FAKE_MODEL)
    assert says in str(info.value) and info.value.about_size().startswith(says.replace(" (width x height)", ""))


def test_a_model_trained_at_one_size_names_it():
    one_size = replace(FAKE_MODEL, name="tiny", min_size=32, max_size=32)
    with pytest.raises(SizeError) as info:
        resolve_params(SamplingParams(prompt="seven", height=64, width=64), one_size)
    assert str(info.value) == ("height: 64x64 (width x height) is not supported; allowed: 32x32 only (tiny was "
                               "trained at that size)")
