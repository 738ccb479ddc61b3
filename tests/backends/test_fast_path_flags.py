"""--compile / --compile-buckets / --deterministic reach the engine from `stepserve serve` and `stepserve bench`;
bad values are refused with a message that says what is allowed."""

from __future__ import annotations

import pytest

from stepserve.backends.batch_buckets import BatchBucketedNetworks
from stepserve.backends.fast_path import FastPathOptions, apply_fast_path


def test_serve_builds_a_deterministic_engine(capsys):
    from stepserve.commands.serve import build_parser, serve_settings
    from stepserve.server.startup import start_engine

    args = build_parser().parse_args(["--deterministic", "--no-memory-cap", "--max-batch-size", "3", "--threads", "1"])
    engine = start_engine(serve_settings(args).engine)
    name = engine.model_info.name
    networks = engine.executor.pipeline.networks
    assert name == "embedded" and isinstance(networks, BatchBucketedNetworks)
    assert networks.fixed_rows == 6 and networks.batch_buckets == (6,)
    # every call at the one fixed size: the warm-up step, and the default strategy's latency measurement
    assert set(networks.calls) == {6} and networks.calls[6] >= 1
    assert "warm-up" in capsys.readouterr().err
    with pytest.raises(ValueError, match="already applied"):
        apply_fast_path(engine.executor, FastPathOptions(compile=True), 3)


def test_serve_and_bench_parse_the_flags():
    from stepserve.commands.bench import config_from_args
    from stepserve.commands.serve import build_parser

    args = build_parser().parse_args(["--compile", "--compile-buckets", "8,1,2"])
    assert args.compile and not args.deterministic and args.compile_buckets == (1, 2, 8)
    cfg = config_from_args(["--model", "embedded", "--compile", "--deterministic"])
    assert cfg.fast_path == FastPathOptions(compile=True, deterministic=True)
    assert not config_from_args(["--model", "embedded"]).fast_path.enabled


@pytest.mark.parametrize("value", ["0,2", "a", "", "1,,2"])
def test_bad_buckets_exit_2_with_what_is_allowed(value, capsys):
    from stepserve.commands.serve import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--compile-buckets", value])
    assert exc.value.code == 2
    assert "expected comma-separated batch sizes >= 1" in capsys.readouterr().err


def test_fast_path_refuses_other_backends_and_modes():
    class Pipeline:
        backend, device, networks = "onnxruntime", "cpu", None

    class Executor:
        pipeline = Pipeline()

    with pytest.raises(ValueError, match="need --backend torch; got --backend onnxruntime"):
        apply_fast_path(Executor(), FastPathOptions(compile=True), 8)
    Pipeline.backend = "torch"
    with pytest.raises(ValueError, match="compile_mode: 'fastest' is not supported; allowed: default"):
        apply_fast_path(Executor(), FastPathOptions(compile=True, compile_mode="fastest"), 8)
    assert apply_fast_path(Executor(), FastPathOptions(), 8) is None  # nothing asked: nothing wrapped


def test_fast_path_switches_classic_attention_to_sdpa():
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    from stepserve.backends.fast_path import _prefer_sdpa
    from stepserve.pipelines.diffusers_sd import StableDiffusionAdapter

    networks = StableDiffusionAdapter.from_pretrained("embedded").networks
    networks.unet.set_attn_processor(AttnProcessor())
    _prefer_sdpa(networks)
    assert {type(p) for p in networks.unet.attn_processors.values()} == {AttnProcessor2_0}


def test_profile_measures_the_deterministic_engine(tmp_path):
    from stepserve.costs import LatencyModel
    from stepserve.commands.profile import main

    out = tmp_path / "latency.json"
    assert main(["--model", "embedded", "--deterministic", "--max-batch-size", "2", "--repeats", "1", "--warmup", "0",
                 "--threads", "1", "--out", str(out)]) == 0
    model = LatencyModel.load(out)
    assert model.metadata["fast_path"] == {"compile": False, "deterministic": True}
    assert model.step_s(1) > 0
