"""Ctrl-C (or SIGTERM) while a peer server starts leaves nothing running: the bench's start-up is cancelled while a
fake peer is still starting (it never gets ready; it has started a helper of its own in another session that ignores
SIGTERM, as Ray's daemons and LitServe's workers do), and every process carrying the peer's tag is gone."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import stepserve.bench.peers.target as peer_target
from stepserve.bench.live import LiveDriver
from stepserve.bench.peers.process import (
    PeerError,
    PeerProcess,
    file_ready,
    tagged_pids,
)
from stepserve.bench.peers.registry import Launch, PeerSetting
from stepserve.bench.runner import TargetMaker

SLOW_PEER = textwrap.dedent("""
    import subprocess, sys, time
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(120)  # never ready
""")


def _fake_launches(tmp_path, monkeypatch) -> list[PeerProcess]:
    script = tmp_path / "slow_peer.py"
    script.write_text(SLOW_PEER)
    started = []

    def launch(setting, ctx, index):
        process = PeerProcess(setting.name, [sys.executable, str(script)], file_ready(tmp_path / "never"),
                              tmp_path / f"{index}.log", start_timeout_s=240.0)  # never ready: the test cancels first
        started.append(process)
        return Launch(process, "http", "http://127.0.0.1:9")

    monkeypatch.setattr(peer_target, "launch", launch)
    return started


async def _when_both_run(process: PeerProcess) -> None:
    while len(tagged_pids(process.tag)) < 2:  # the peer and its helper
        await asyncio.sleep(0.05)


def test_cancelling_the_bench_while_a_peer_starts_leaves_no_process(tmp_path, monkeypatch):
    started = _fake_launches(tmp_path, monkeypatch)
    maker = TargetMaker("ray", lambda: peer_target.PeerTarget(PeerSetting("ray", 2, 10.0), ctx=None))

    async def main():
        run = asyncio.ensure_future(LiveDriver().run(maker, None, 0, lambda _: None))
        while not started:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(_when_both_run(started[0]), 240)
        t0 = time.monotonic()
        run.cancel()  # what asyncio.run does on Ctrl-C (and the bench on SIGTERM)
        try:
            await run
        except asyncio.CancelledError:
            pass
        return time.monotonic() - t0, tagged_pids(started[0].tag)

    took, left = asyncio.run(main())
    assert left == [] and took < 10


def test_a_cancelled_start_refuses_to_launch(tmp_path):
    peer = PeerProcess("late", [sys.executable, "-c", "pass"], lambda: True, tmp_path / "log")
    peer.cancel()  # cancelled before its thread got to launch anything
    try:
        peer.start()
    except PeerError as e:
        assert "start-up interrupted" in str(e)
    else:
        raise AssertionError("start() launched after cancel()")
    assert peer.process is None
