"""The combination matrix: every pair of features (`--quantize`, `--offload`, single-file and GGUF weights, LoRA,
ControlNets, IP-Adapters, each cache, image to image, inpainting, `--deterministic`, `--compile`, video), generated
from the families' declarations (stepserve/capabilities.py; the parts are tests/feature_pairs.py), on the first tiny
family that serves both. Each pair is served (a request with both is served, and inside a mixed batch with a plain
request and another of its kind gets the image it gets alone), or refused at start-up (a ValueError, one line,
naming both) or at admission (a ValidationError, a 400, naming both): whichever the declarations say. No pair
fails a request (a 500). The whole matrix runs with the slow tests; a fixed sample of a few cheap pairs in the
default run. docs/MODELS.md ("Which features with which") lists the refusals."""

import numpy as np
import pytest
from feature_pairs import (FEATURES, REQUEST, START, Tiny, engine_config, expected, host, names_both, pairs,
                           request, sampled)

from stepserve import Engine, ValidationError
from stepserve.engine.config import build_engine
from stepserve import capabilities as caps

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)
# Pairs that answered 500 per request before they were refused, run in the default run beside the sample: an
# IP-Adapter on a quantized UNet (int8wo, GGUF), a cache on the fast path, LoRA rows on its padded batches.
REGRESSIONS = [("quantize", "ip_adapter"), ("gguf", "ip_adapter"), ("deterministic", "fbcache"),
               ("deterministic", "lora")]
SAMPLE = sampled(4)
DEFAULT = SAMPLE + [p for p in REGRESSIONS if p not in SAMPLE]
_ENGINES: dict = {}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Tiny(tmp_path_factory.mktemp("pairs"))


def build(tiny, family, features):
    """An Engine of `family` with the start-up `features` and the add-on folders of the request ones, built once
    per module (ValueError: refused at start-up)."""
    key = (family, frozenset(features))
    if key not in _ENGINES:
        config, offload = engine_config(tiny, family, set(features))
        executor = None
        if offload:  # build_engine refuses --offload on the CPU; the hooks are in place all the same
            from stepserve.engine.loading import check_pairs
            from stepserve.executor.torch_executor import TorchExecutor
            from stepserve.pipelines.registry import load_family_adapter

            check_pairs(config)
            executor = TorchExecutor(load_family_adapter(config.model, device="cpu", weights=config.weights))
        built = build_engine(config, executor=executor)
        _ENGINES[key] = Engine(built.executor, options=built.options)
    return _ENGINES[key]


def frames(result):
    images = result.frames if result.frames is not None else [result.image]
    return np.stack([np.asarray(i.convert("RGB"), dtype=np.int16) for i in images])


def check_pair(tiny, pair):
    family, want = host(pair), expected(pair)
    if {"quantize"} & set(pair):
        pytest.importorskip("torchao")
    if {"gguf"} & set(pair):
        pytest.importorskip("gguf")
    if want == "start":
        with pytest.raises(ValueError) as err:
            build(tiny, family, pair)
        message = str(err.value)
        assert "\n" not in message and names_both(message, pair), message
        return
    engine = build(tiny, family, pair)
    wanted = set(pair) & set(REQUEST)
    mine = [request(family, wanted, i) for i in range(2)]
    if want == "admission":
        with pytest.raises(ValidationError) as err:
            engine.generate([mine[0]])
        assert names_both(str(err.value), pair), str(err.value)
        return
    alone = engine.generate([mine[0]])[0]
    assert alone.ok, (pair, alone.error)
    together = engine.generate([mine[0], request(family, set(), 5), mine[1]])
    assert all(r.ok for r in together), (pair, [r.error for r in together])
    assert np.abs(frames(together[0]) - frames(alone)).max() <= 1, pair


def test_the_matrix_covers_every_feature_and_refuses_only_what_is_declared():
    """Every feature is in some served or refused pair; the refusals at start-up are the declared ones."""
    covered = {x for p in pairs() for x in p}
    assert covered == set(FEATURES)
    assert {frozenset(p) for p in pairs() if expected(p) == "start"} <= set(caps.PAIRS_REFUSED)
    named = set(FEATURES) | {"cache"}  # "cache": the server's --cache default
    assert all(set(p) <= named for p in [*caps.PAIRS_REFUSED, *caps.PAIRS_REFUSED_PER_REQUEST])
    assert len(SAMPLE) == 4 and len(pairs()) > 60 and set(REGRESSIONS) <= set(pairs())


@pytest.mark.parametrize("pair", DEFAULT, ids=" + ".join)
def test_sampled_pairs(tiny, pair):
    check_pair(tiny, pair)


@pytest.mark.slow
@pytest.mark.parametrize("pair", [p for p in pairs() if p not in DEFAULT], ids=" + ".join)
def test_every_pair(tiny, pair):
    check_pair(tiny, pair)


def test_start_up_refusals_come_before_anything_loads(tiny):
    """A refused pair costs no load: check_pairs answers from the flags alone (a folder that is not there)."""
    from stepserve.engine.config import EngineConfig
    from stepserve.engine.loading import check_pairs
    from stepserve.pipelines.weights import Weights

    for pair in caps.PAIRS_REFUSED:
        with pytest.raises(ValueError) as err:  # the flags themselves (Weights: --quantize of a GGUF file), or
            check_pairs(engine_config(tiny, "sd", set(pair))[0])
        assert names_both(str(err.value), tuple(pair)), str(err.value)
    plain = EngineConfig(model="/nowhere", weights=Weights(quantize="int8wo"), lora_dir="/nowhere")
    check_pairs(plain)  # a served pair passes


