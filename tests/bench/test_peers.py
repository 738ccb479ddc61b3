"""`stepserve bench --peers`: peer servers (Ray Serve, LitServe, Triton) on loopback against `stepserve serve`.

The heavy test runs one short bench with every peer: each starts, answers with images of the model's size (the
same images as stepserve's, since every contender runs the same networks and samplers), is stopped with nothing
left behind, and results.json / report.md carry a row, the versions and the configuration of each contender."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from extras import require
from PIL import Image

from stepserve.commands.bench import UsageError, config_from_args
from stepserve.bench.peers import PeerSetting, parse_peers
from stepserve.bench.peers.process import TAG_ENV, PeerError, PeerProcess, file_ready, tagged_pids


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (dead, waiting for its parent, here maybe a container's init) is not alive."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _our_peer_pids() -> list[int]:
    """Every live process started as a peer by this test process (tags begin with our pid)."""
    prefix = f"{TAG_ENV}={os.getpid()}-".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            values = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if any(v.startswith(prefix) for v in values) and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_parse_peers_grid_and_single_settings():
    assert parse_peers("ray") == [PeerSetting("ray", b, w) for b in (4, 8) for w in (10.0, 50.0)]
    assert parse_peers("litserve@8x50,triton@4x0") == [PeerSetting("litserve", 8, 50.0), PeerSetting("triton", 4, 0.0)]
    assert [s.name for s in parse_peers("ray@8x50")] == ["ray(b8,50ms)"]
    for bad, words in (("tgi", "unknown peer 'tgi'"), ("ray@8", "NAME@BATCHxWAIT_MS"), ("ray@0x10", ">= 1"),
                       ("", "nothing given")):
        with pytest.raises(ValueError, match=words):
            parse_peers(bad)


def test_bench_flags_for_peers():
    cfg = config_from_args(["--peers", "triton@4x10,ray@8x50"])
    assert cfg.backend == "onnxruntime"  # Triton's classic layout runs onnxruntime: every contender does
    assert [c.name for c in cfg.contenders] == ["slo"]  # stepserve serve with its default strategy
    assert [p.name for p in cfg.peers] == ["triton(b4,10ms)", "ray(b8,50ms)"]
    assert config_from_args(["--peers", "ray@8x50"]).backend == "torch"
    for argv, words in ((["--peers", "triton", "--backend", "torch"], "--backend onnxruntime"),
                        (["--peers", "ray", "--target", "http://127.0.0.1:9"], "exclude each other"),
                        (["--peers", "tgi"], "unknown peer"), (["--peers", "ray", "--model", "fake"], "not --model fake")):
        with pytest.raises(UsageError, match=words):
            config_from_args(argv)
    with pytest.raises(UsageError, match="not stepserve simulate"):
        config_from_args(["--peers", "ray"], command="simulate")


STUBBORN = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    # a helper in a session of its own that ignores SIGTERM: what LitServe's workers and Ray's daemons amount to
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.5)
    open(sys.argv[1], "w").write("ready")
    time.sleep(120)
""")


def test_stop_leaves_no_process_behind(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    ready = tmp_path / "ready"
    peer = PeerProcess("stubborn", [sys.executable, str(script), str(ready)], file_ready(ready), tmp_path / "log")
    peer.start()
    pids = tagged_pids(peer.tag)
    assert len(pids) == 2  # the child and the helper it started in another session
    peer.stop(grace_s=1.0)
    assert tagged_pids(peer.tag) == []
    assert not any(_alive(pid) for pid in pids)


def test_a_peer_that_dies_while_starting_says_why(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(PeerError, match=r"exited with code 3(.|\n)*no model here"):
        PeerProcess("broken", argv, lambda: False, tmp_path / "log").start()


def test_handler_runs_a_batch_like_stepserve_runs_each_request():
    """Same per-step work: the peers' batch handler gives each request the image stepserve gives it alone."""
    from stepserve import Engine, SamplingParams
    from stepserve.bench.peers.handler import BatchHandler, HandlerOptions, PeerRequestError

    handler = BatchHandler(HandlerOptions(threads=1, max_batch_size=4))
    bodies = [{"prompt": "seven", "seed": 3, "num_inference_steps": 6, "guidance_scale": 3.0},
              {"prompt": "two", "seed": 5, "num_inference_steps": 4}]
    answers = handler.run([handler.parse(json.dumps(b)) for b in bodies])
    alone = Engine(handler.engine.executor, strategy="none").generate([SamplingParams(**b) for b in bodies])
    for answer, result in zip(answers, alone):
        image = Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))
        diff = np.abs(np.asarray(image, dtype=int) - np.asarray(result.image, dtype=int))
        assert diff.max() <= 1
    with pytest.raises(PeerRequestError, match="num_inference_steps"):
        handler.parse(b'{"prompt": "seven", "num_inference_steps": 0}')
    with pytest.raises(PeerRequestError, match="unknown field 'seeds'"):
        handler.parse({"prompt": "seven", "seeds": 1})


@pytest.fixture(scope="module")
def peer_bench(tmp_path_factory):
    for module, extra in (("ray", "ray"), ("litserve", "litserve"), ("tritonclient", "triton"),
                          ("pytriton", "triton")):
        require(module, extra)
    from stepserve.bench.app import run_bench, write_outputs

    out = tmp_path_factory.mktemp("peers")
    cfg = config_from_args(["--peers", "ray@2x10,litserve@2x10,triton@2x10", "--max-batch-size", "2", "--steps", "4",
                            "--rate", "2", "--duration", "2", "--warmup", "0.5", "--drain", "20",
                            "--slo-p95-ms", "5000", "--threads", "1", "--out", str(out), "--no-progress"])
    cfg.keep_images = True
    run = asyncio.run(run_bench(cfg))
    write_outputs(run, out)
    return run, out


@pytest.mark.slow  # three peer servers started and driven: about a minute
def test_peer_bench_rows_versions_configs_and_images(peer_bench):
    run, out = peer_bench
    names = ["stepserve-slo", "ray(b2,10ms)", "litserve(b2,10ms)", "triton(b2,10ms)"]
    results = json.loads((out / "results.json").read_text())
    assert [s["contender"] for s in results["summaries"]] == names
    for s in results["summaries"]:
        assert s["offered"] > 0 and s["completed"] == s["offered"], s
    report = (out / "report.md").read_text()
    for name in names:
        assert f"| {name} | " in report
    peers = {p["name"]: p for p in results["settings"]["peers"]}
    assert list(peers) == names
    assert peers["ray(b2,10ms)"]["versions"]["ray"] == metadata.version("ray")
    assert peers["litserve(b2,10ms)"]["versions"]["litserve"] == metadata.version("litserve")
    assert peers["triton(b2,10ms)"]["versions"]["nvidia-pytriton"] == metadata.version("nvidia-pytriton")
    assert peers["ray(b2,10ms)"]["config"]["@serve.batch batch_wait_timeout_s (ms)"] == 10.0
    assert peers["litserve(b2,10ms)"]["config"]["LitAPI max_batch_size"] == 2
    assert peers["triton(b2,10ms)"]["config"]["max_batch_size (dynamic_batching)"] == 2
    assert all(p["config"]["backend"] == "onnxruntime" for p in peers.values())

    # every contender answered every request with an image of the model's size, and the same image as
    # stepserve's for the same request (same networks and samplers; batching differs): uint8 within 1
    by_contender = {r.metrics.contender: {im.index: np.asarray(im.image) for im in r.images} for r in run.runs}
    from stepserve.engine.loading import load_executor

    model = load_executor("embedded").model_info
    reference = by_contender["stepserve-slo"]
    assert len(reference) == len(run.plan.trace.items)
    for name in names:
        images = by_contender[name]
        assert set(images) == set(reference), name
        for index, pixels in images.items():
            assert pixels.shape[:2] == (model.default_height, model.default_width)
            assert np.abs(pixels.astype(int) - reference[index].astype(int)).max() <= 1, (name, index)


@pytest.mark.slow
def test_peer_bench_leaves_no_process_behind(peer_bench):
    assert _our_peer_pids() == []
    leftovers = subprocess.run(["pgrep", "-f", "tritonserver --model-repository=" + str(peer_bench[1])],
                               capture_output=True, text=True).stdout.split()
    assert leftovers == []
