"""Guess mode per request (SD 1/2, SDXL): a request alone equals the family's diffusers ControlNet pipeline with
guess_mode=True (uint8 within 1; one ControlNet and two; guidance on, and off where guess mode changes only the
scales), a ControlNet with global_pool_conditions is always in guess mode and equals diffusers too, and in mixed
batches (guess rows, other control rows, plain rows, a pooling ControlNet, guidance on and off), under every
strategy, each image is the one it gets alone."""

import json
import shutil

import numpy as np
import pytest
from control_reference import build_controlnets, diffusers_controlnet, request
from edit_images import pixels

from stepserve import Engine
from strategy_params import EVERY_STRATEGY

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


def add_pooled(folder):
    """`pooled`: a copy of `pose` whose config has global_pool_conditions (its outputs are pooled per channel)."""
    shutil.copytree(folder / "pose", folder / "pooled")
    config = json.loads((folder / "pooled" / "config.json").read_text())
    (folder / "pooled" / "config.json").write_text(json.dumps({**config, "global_pool_conditions": True}))
    return folder


@pytest.fixture(scope="module", params=["sd", "sdxl"])
def family(request, tiny_sd_path, tmp_path_factory):
    """(family, its tiny pipeline folder, its ControlNet folder with `pooled` too)."""
    root = tmp_path_factory.mktemp(f"guess_{request.param}")
    if request.param == "sdxl":
        from stepserve.tiny.sdxl import build_tiny_sdxl

        pipe = build_tiny_sdxl(root / "pipe")
    else:
        pipe = tiny_sd_path
    return request.param, pipe, add_pooled(build_controlnets(pipe, root / "controlnets"))


@pytest.fixture(scope="module")
def engine(family):
    return Engine.from_pretrained(str(family[1]), strategy="continuous", max_batch_size=8,
                                  controlnet_dir=str(family[2]))


CASES = [
    ((("pose", 1.0, 0.0, 1.0),), 4.0),
    ((("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.3, 1.0)), 4.0),
    ((("depth", 0.9, 0.1, 0.9),), 1.0),  # no guidance: guess mode changes only the scales
    ((("edge", 1.0, 0.0, 1.0), ("pose", 0.7, 0.2, 1.0)), 1.0),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_alone_equals_the_diffusers_pipeline_in_guess_mode(family, engine, case):
    controls, guidance = CASES[case]
    p = request(case, controls, guidance=guidance, guess=True)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert all(c.guess_mode for c in got.params.controls)
    assert np.abs(pixels(got.image) - diffusers_controlnet(family[1], family[2], p, family[0])).max() <= 1
    plain = engine.generate([request(case, controls, guidance=guidance)])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 4  # guess mode did change the image


@pytest.mark.parametrize("controls,guess", [((("pooled", 1.0, 0.0, 1.0),), None),
                                            ((("depth", 1.0, 0.2, 1.0), ("pooled", 0.8, 0.0, 1.0)), True)])
@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_a_pooling_controlnet_alone_equals_diffusers(family, engine, controls, guess, guidance):
    """diffusers' pipeline forces guess mode for a ControlNet with global_pool_conditions; so does the request."""
    p = request(9, controls, guidance=guidance, guess=guess)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert all(c.guess_mode for c in got.params.controls)
    assert np.abs(pixels(got.image) - diffusers_controlnet(family[1], family[2], p, family[0])).max() <= 1
    plain = engine.generate([request(9, (), guidance=guidance)])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 0  # the pooled control did change the image


def mixed():
    rows = [((("pose", 1.0, 0.0, 1.0),), True), ((), None), ((("pose", 0.9, 0.0, 1.0),), None),
            ((("pooled", 1.0, 0.0, 1.0),), None), ((("depth", 0.6, 0.3, 1.0), ("pose", 1.2, 0.0, 0.5)), True),
            ((("depth", 1.0, 0.0, 1.0), ("pooled", 0.7, 0.0, 0.6)), None), ((("edge", 0.8, 0.0, 1.0),), False)]
    out = [request(40 + i, controls, guidance=[4.0, 1.0, 6.0][i % 3], steps=[5, 6][i % 2], guess=guess)
           for i, (controls, guess) in enumerate(rows)]
    out[5].controls[0]["guess_mode"] = True  # beside a pooling ControlNet every control is in guess mode
    return out


@pytest.fixture(scope="module")
def alone(engine):
    return [engine.generate([p])[0] for p in mixed()]


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image(family, alone, strategy):
    engine = Engine.from_pretrained(str(family[1]), strategy=strategy, max_batch_size=7, max_queue_delay_ms=1,
                                    controlnet_dir=str(family[2]))
    together = engine.generate(mixed())
    assert all(r.ok for r in together), [r.error for r in together]
    assert [bool(r.params.controls) and r.params.controls[0].guess_mode for r in together] == [
        True, False, False, True, True, True, False]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_guess_rows_run_the_controlnet_on_their_conditional_row_only(family, monkeypatch):
    """A guided request in guess mode gives its ControlNet one row (diffusers: zeros for the unconditional row);
    one not in guess mode two; both share the ControlNet's one forward."""
    engine = Engine.from_pretrained(str(family[1]), strategy="static", static_batch_size=2, max_batch_size=2,
                                    controlnet_dir=str(family[2]))
    store = engine.executor.controlnets()
    seen: list[int] = []
    ensure = store.ensure

    def counted(net):
        def run(sample, *args, **kwargs):
            seen.append(sample.shape[0])
            return net(sample, *args, **kwargs)
        run.config = net.config
        return run

    monkeypatch.setattr(store, "ensure",
                        lambda names, **kw: {n: counted(m) for n, m in ensure(names, **kw).items()})
    results = engine.generate([request(50, (("pose", 1.0, 0.0, 1.0),), steps=3, guess=True),
                               request(51, (("pose", 0.5, 0.0, 1.0),), steps=3)])
    assert all(r.timing.batch_sizes == [2] * 3 for r in results)
    assert seen == [1 + 2] * 3


def test_guess_mode_false_beside_a_pooling_controlnet_is_refused(family, engine):
    from stepserve import ValidationError

    assert engine.model_info.control_guess_only == frozenset({"pooled"})
    for controls, at in (((("pooled", 1.0, 0.0, 1.0),), 0), ((("pose", 1.0, 0.0, 1.0), ("pooled", 1.0, 0.0, 1.0)), 0)):
        p = request(60, controls)
        p.controls[at]["guess_mode"] = False
        with pytest.raises(ValidationError) as err:
            engine.generate([p])
        assert err.value.field == f"controls[{at}].guess_mode"
        assert f"controls[{len(controls) - 1}] ('pooled') runs in guess mode only" in str(err.value)
        assert "global_pool_conditions" in str(err.value) and "allowed: true or unset" in str(err.value)
