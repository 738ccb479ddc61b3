"""`kill PID` (SIGTERM, what `docker stop` and systemd send) stops `stepserve bench` and `stepserve demo` as Ctrl-C
does: promptly, exit status 130, and nothing left behind: no process (peer servers included, even one caught
starting), no temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from leftovers import Command, gone_within

from stepserve.bench.peers.process import TAG_ENV as PEER_TAG_ENV


def _check_terminated(command: Command, exit_within_s: float) -> None:
    code, _ = command.terminate_and_wait(exit_within_s)
    assert code == 130, (code, command.output[-3000:])
    assert "interrupted" in command.output
    assert gone_within(command.processes, 60) == []  # bounds a hang only
    assert list(command.tmpdir.iterdir()) == []


def _running(command: Command, text: str) -> None:
    assert command.wait_for(lambda: text in command.output, 120), command.output[-3000:]


@pytest.mark.parametrize("verb", ["bench", "demo"])
def test_sigterm_stops_an_in_process_bench_and_the_demo(tmp_path, verb):
    # promptly: it would run for 10 minutes; it ends with 130 and "interrupted" (a bound of minutes only stops a hang)
    command = Command([verb, "--model", "fake", "--duration", "600", "--out", str(tmp_path / "out")], tmp_path)
    try:
        _running(command, "idle latency: started")
        _check_terminated(command, 120)
    finally:
        command.clean_up()


def test_sigterm_during_a_peer_start_stops_the_peer(tmp_path):
    """The bench's first server (stepserve serve, the reference) is still starting when SIGTERM arrives."""
    command = Command(["bench", "--peers", "ray@2x10", "--model", "embedded", "--threads", "1", "--duration", "5",
                       "--out", str(tmp_path / "out")], tmp_path)

    def peer_started() -> bool:
        for pid in command.processes():
            try:
                if f"{PEER_TAG_ENV}=".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    return True
            except OSError:
                pass
        return False

    try:
        assert command.wait_for(peer_started, 120), command.output[-3000:]
        _check_terminated(command, 120)
    finally:
        command.clean_up()
