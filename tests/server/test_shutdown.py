"""`stepserve serve` as a real process: one-line flag errors; SIGTERM drains in-flight work and exits 0."""

from __future__ import annotations

import signal
import subprocess
import threading

import httpx
from server_helpers import GENERATIONS, assert_error_shape, decode_png, up_or_gone, wait_until

from stepserve.commands.serve import main

HANG_S = 240  # how long a wait may take before the test calls it a hang (pytest-timeout stops a test at 300 s)


def _exit_code(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exc:
        return int(exc.code)


def test_bad_flags_get_one_line_naming_allowed_values(capsys):
    for args, expected in ((["--strategy", "fastest"], "continuous"), (["--dtype", "int8"], "bfloat16"),
                           (["--port", "http"], "65535"), (["--max-queue", "-3"], ">= 1"),
                           (["--device", "tpu"], "cuda"), (["--model", "/no/such/folder"], "embedded")):
        assert _exit_code(args) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], lines


def test_sigterm_finishes_in_flight_refuses_new_and_exits_0(early_cli_server):
    """The server's denoising steps wait until the test frees them (gated_serve.py; one request per step): the
    three requests are in flight (one in its first step, two queued) when SIGTERM arrives and while a new one is
    refused, whatever the machine's speed. Every wait is on the server's own report; its bound only stops a hang."""
    proc, url = early_cli_server.proc, early_cli_server.url
    try:
        def health() -> httpx.Response:
            return httpx.get(url + "/health", timeout=30)

        assert wait_until(up_or_gone(url, proc), HANG_S, 0.2) and proc.poll() is None, \
            f"waited for the server to answer /health: {proc.stderr.read() if proc.poll() is not None else ''}"
        results: list[httpx.Response] = []
        body = {"prompt": "in flight", "num_inference_steps": 40, "guidance_scale": 1.0, "seed": 3}
        workers = [threading.Thread(target=lambda: results.append(httpx.post(url + GENERATIONS, json=body,
                                                                             timeout=HANG_S))) for _ in range(3)]
        for w in workers:
            w.start()
        assert wait_until(lambda: health().json()["queue_depth"] == 2, HANG_S), \
            f"waited for the three requests to be in flight (one held in its step, two queued): {health().json()}"
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health().status_code == 503, HANG_S), \
            f"waited for /health to say the server drains after SIGTERM: {health().json()}"
        assert health().json()["status"] == "draining"
        late = httpx.post(url + GENERATIONS, json=body, timeout=HANG_S)
        assert_error_shape(late, 503)
        assert not results and proc.poll() is None  # nothing has finished: the three are still in flight
        proc.stdin.write("free\n")
        proc.stdin.flush()
        for w in workers:
            w.join(HANG_S)
        assert not any(w.is_alive() for w in workers), "waited for the three requests in flight to be answered"
        assert [r.status_code for r in results] == [200, 200, 200], [r.text for r in results]
        assert all(decode_png(r.json()["data"][0]["b64_json"]).size == (16, 16) for r in results)
        try:
            code = proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            raise AssertionError("waited for the server to exit once its work was done") from None
        assert code == 0, proc.stderr.read()
    finally:
        early_cli_server.stop()
