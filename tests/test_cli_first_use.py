"""What a first user meets on the command line: flags that can be checked without the model fail before it
loads, naming the flag; `train-embedded` never overwrites the shipped model unless told; `tiny` reports an
unwritable folder in one line; a relative --lora-dir works."""

from __future__ import annotations

import pytest

from stepserve.commands.serve import build_parser, serve_settings
from stepserve.server.startup import StartupError


def settings(*argv: str):
    return serve_settings(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("argv,says", [
    (["--cache", "teacache"], "--cache: policy 'teacache' is not a caching policy"),
    (["--cache", '{"interval": 2}'], "--cache: an object needs \"policy\""),
    (["--cache", '{"policy": "deepcache", "interval": 0}'], "--cache: deepcache interval must be an integer"),
    (["--lora-dir", "/no/such/folder"], "--lora-dir: '/no/such/folder' is not a folder"),
    (["--cache", "deepcache", "--backend", "onnxruntime"], "--cache need --backend torch"),
    (["--lora-dir", ".", "--deterministic"], "--deterministic with --lora-dir is not served (LoRA rows"),
    (["--cache", "fbcache", "--compile"], "--cache with --compile is not served"),
    (["--ip-adapter-dir", ".", "--quantize", "int8wo"], "--ip-adapter-dir with --quantize is not served"),
    (["--ip-adapter-dir", ".", "--offload", "group"], "--ip-adapter-dir with --offload group is not served"),
])
def test_cache_and_lora_flags_fail_before_the_model_loads(argv, says, monkeypatch):
    import stepserve.engine.loading as loading

    monkeypatch.setattr(loading, "load_executor", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(StartupError) as err:
        settings(*argv)
    assert says in str(err.value)


def test_a_relative_lora_dir_is_taken_from_the_working_folder(tmp_path, monkeypatch):
    from extras import require

    require("peft", "lora")
    from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
    from stepserve.tiny.lora import build_tiny_lora

    build_tiny_lora("embedded", tmp_path / "loras" / "ink.safetensors", rank=4)
    monkeypatch.chdir(tmp_path)
    built = build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir="loras",
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    assert sorted(built.executor.adapters().adapters) == ["ink"]


def test_train_embedded_needs_out_or_replace_embedded(capsys):
    from stepserve.commands.train_embedded import build_parser as train_parser

    with pytest.raises(SystemExit) as exit_:
        train_parser().parse_args([])
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err
    from stepserve.training.embedded import DEFAULT_OUT

    assert train_parser().parse_args(["--replace-embedded"]).out == DEFAULT_OUT


def test_tiny_into_an_unwritable_folder_is_one_line(capsys):
    from stepserve.commands.tiny import main as tiny_main

    with pytest.raises(SystemExit) as exit_:
        tiny_main(["sd", "--out", "/proc/no/such/place"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--out: cannot write /proc/no/such/place" in err and "Traceback" not in err
