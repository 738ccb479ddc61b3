"""Mistakes a new user makes on the command line end in one line on stderr that names the problem and the fix,
with exit code 2, not a traceback: a backend whose extra is not installed, a bench target where nothing listens."""

from __future__ import annotations

import importlib.metadata
import socket

import pytest

from stepserve.util.ports import free_port


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.fixture
def without_onnx(monkeypatch, tmp_path):
    """As if the onnx extra were not installed: neither module imports, neither distribution is found."""
    for module in ("onnx", "onnxruntime"):
        monkeypatch.setitem(__import__("sys").modules, module, None)
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name in ("onnx", "onnxruntime"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setenv("STEPSERVE_CACHE", str(tmp_path / "cache"))  # no export cached from an earlier run


def test_serve_on_onnxruntime_without_the_extra_is_one_line(without_onnx, capsys, monkeypatch):
    import stepserve.engine.loading as loading
    from stepserve.cli import main

    monkeypatch.setattr(loading, "load_executor", lambda *a, **k: pytest.fail("the model was loaded"))
    code = main(["serve", "--backend", "onnxruntime", "--port", str(free_port())])
    line = one_line(capsys.readouterr().err)
    assert code == 2
    assert "--backend onnxruntime" in line and "pip install 'stepserve[onnx]'" in line and "onnxruntime" in line


def test_bench_on_onnxruntime_without_the_extra_is_one_line(without_onnx, capsys):
    from stepserve.cli import main

    code = main(["bench", "--backend", "onnxruntime", "--no-progress", "--duration", "1"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "pip install 'stepserve[onnx]'" in line


def test_bench_at_an_address_where_nothing_listens_is_one_line(capsys, tmp_path):
    from stepserve.cli import main

    with socket.socket() as held:  # a port bound but not listening: a connection to it is refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        code = main(["bench", "--target", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "out")])
    line = one_line(capsys.readouterr().err)
    assert code == 2
    assert f"nothing answers at 127.0.0.1:{port}" in line and "start the server" in line
    assert not (tmp_path / "out").exists()


def test_bench_counts_one_contender_per_target():
    from stepserve.commands.bench import config_from_args, start_line

    one = start_line(config_from_args(["--target", "http://127.0.0.1:8000"]))
    assert one.startswith("target http://127.0.0.1:8000; 1 contender;"), one
    two = start_line(config_from_args(["--target", "a=http://127.0.0.1:8000", "--target", "b=http://127.0.0.1:8001"]))
    assert "; 2 contenders;" in two, two


@pytest.mark.parametrize("argv,says", [
    (["--model", "{tmp}/sd15.safetensors"], "--model {tmp}/sd15.safetensors is one file: add --config DIR"),
    (["--model", "{tmp}/sd15.safetensors", "--config", "{tmp}/none"], "--config: '{tmp}/none' is neither"),
    (["--model", "{tmp}/none"], "--model: '{tmp}/none' is neither"),
])
def test_serve_a_whole_model_file_names_config(argv, says, tmp_path, capsys, monkeypatch):
    """A lone whole-model file is told about --config (not that it is no folder), and a --config that is no
    folder is named as --config."""
    import stepserve.engine.loading as loading
    from stepserve.cli import main

    (tmp_path / "sd15.safetensors").write_bytes(b"")
    monkeypatch.setattr(loading, "load_executor", lambda *a, **k: pytest.fail("the model was loaded"))
    code = main(["serve", "--port", str(free_port()), *(a.format(tmp=tmp_path) for a in argv)])
    assert code == 2 and says.format(tmp=tmp_path) in one_line(capsys.readouterr().err)
