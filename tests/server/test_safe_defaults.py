"""`stepserve serve` protects a fresh install: a bounded queue and a default deadline unless turned off, a busy port
fails at once, and the API key need not appear on a command line (nor in what Ray stores for its replicas)."""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stepserve.util.api_key import API_KEY_ENV
from stepserve.commands.serve import build_parser, serve_settings
from stepserve.server.startup import StartupError, for_replicas, replica_api_key

ROOT = Path(__file__).resolve().parents[2]


def settings_of(*flags: str):
    return serve_settings(build_parser().parse_args(["--no-memory-cap", *flags]))


def test_a_fresh_install_has_a_bounded_queue_and_a_default_deadline(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    s = settings_of()
    assert s.engine.options.max_queue == 64  # 8 full batches of the default --max-batch-size 8
    assert s.limits.default_timeout_s == 600.0
    assert settings_of("--max-batch-size", "2").engine.options.max_queue == 16
    assert settings_of("--max-batch-size", "1", "--max-n", "16").engine.options.max_queue == 16  # room for max n
    assert settings_of("--max-queue", "5").engine.options.max_queue == 5
    assert settings_of("--timeout-s", "30").limits.default_timeout_s == 30.0


@pytest.mark.parametrize("off", ["0", "none", "None"])
def test_the_protections_can_be_turned_off(off):
    s = settings_of("--max-queue", off, "--timeout-s", off)
    assert s.engine.options.max_queue is None and s.limits.default_timeout_s is None


@pytest.mark.parametrize("flag, value", [("--max-queue", "-1"), ("--max-queue", "many"), ("--timeout-s", "-5"),
                                         ("--timeout-s", "nan")])
def test_bad_protection_values_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([flag, value])
    assert "none" in capsys.readouterr().err.lower() or flag == "--timeout-s"


def test_a_busy_port_fails_at_once_before_anything_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "stepserve.cli", "serve", "--port", str(port), "--threads", "1"],
                              cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True,
                              text=True, timeout=240)  # bounds a hang only
    assert done.returncode == 2, done.stderr
    # at once: it stopped before anything loaded (what a busy machine cannot blur, unlike a time bound)
    assert "loading" not in done.stderr and "on http://" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "already in use" in lines[0], lines


def test_a_busy_port_is_checked_before_a_local_ray_cluster_starts(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        from stepserve.commands.serve import main

        assert main(["--replicas", "1", "--port", str(busy.getsockname()[1])]) == 2
    assert "already in use" in capsys.readouterr().err


def test_the_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert settings_of().api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert settings_of().api_key == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    s = settings_of("--api-key-file", str(key_file))
    assert s.api_key == "from-file" and s.api_key_file == str(key_file)
    assert settings_of("--api-key", "from-flag").api_key == "from-flag"
    for flags, message in ((["--api-key", "a", "--api-key-file", str(key_file)], "not both"),
                           (["--api-key-file", str(tmp_path / "missing")], "cannot be read")):
        with pytest.raises(StartupError, match=message):
            settings_of(*flags)
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(StartupError, match="empty"):
        settings_of("--api-key-file", str(tmp_path / "empty"))


def test_replicas_get_the_key_without_it_in_their_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "k3y-in-the-environment")
    travelling = for_replicas(settings_of())
    assert b"k3y-in-the-environment" not in pickle.dumps(travelling)  # what Ray pickles and stores
    assert replica_api_key(travelling) == "k3y-in-the-environment"  # a local cluster inherits the environment
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(StartupError, match="finds none"):  # never serve open when a key was asked for
        replica_api_key(travelling)
    key_file = tmp_path / "key"
    key_file.write_text("k3y-in-a-file")
    travelling = for_replicas(settings_of("--api-key-file", str(key_file)))
    assert b"k3y-in-a-file" not in pickle.dumps(travelling) and replica_api_key(travelling) == "k3y-in-a-file"
    assert replica_api_key(for_replicas(settings_of())) is None  # no key asked for: none needed


@pytest.mark.parametrize("flags, share", [
    (["--replicas", "2"], 0.5),  # two replicas on one host's memory
    (["--replicas", "1", "--autoscale", "1:2", "--replica-cpus", "0.5"], 0.5),  # as many as the autoscaler may start
    (["--replicas", "1"], 1.0),
    (["--replicas", "2", "--device", "cuda", "--replica-gpus", "0.5"], 0.5),  # two on one GPU
    (["--replicas", "4", "--device", "cuda", "--replica-gpus", "0.5"], 0.5),
    (["--replicas", "2", "--device", "cuda", "--replica-gpus", "1"], 1.0),  # a GPU each
])
def test_replicas_sharing_memory_split_the_cap_budget(flags, share, monkeypatch):
    from stepserve.server.ray.options import plan_replicas, replica_settings

    args = build_parser().parse_args(flags)
    plan = plan_replicas(args, local_cores=8)
    assert plan.memory_share == pytest.approx(share)
    settings = replica_settings(settings_of(*flags), plan)
    assert settings.engine.memory_share == pytest.approx(share)


def test_the_triton_launcher_takes_the_key_the_same_way(tmp_path, monkeypatch):
    from stepserve.deploy.triton import server as triton

    seen = {}

    class Launcher:
        def __init__(self, repository, ports, log_file, host, api_key=None):
            seen["key"] = api_key
            raise triton.TritonServerError("not started in this test")

    monkeypatch.setattr(triton, "TritonServer", Launcher)
    monkeypatch.setenv(API_KEY_ENV, "triton-env-key")
    with pytest.raises(triton.TritonServerError):
        triton.main([str(tmp_path)])
    assert seen["key"] == "triton-env-key"
    (tmp_path / "key").write_text("triton-file-key")
    with pytest.raises(triton.TritonServerError):
        triton.main([str(tmp_path), "--api-key-file", str(tmp_path / "key")])
    assert seen["key"] == "triton-file-key"
    flags = triton.restricted_flags("triton-file-key")
    assert any(f.startswith("--http-restricted-api=") and f.endswith(":authorization=Bearer triton-file-key")
               for f in flags)
    assert any(f.startswith("--grpc-restricted-protocol=") and "health" not in f for f in flags)
    assert triton.restricted_flags(None) == []
