"""`stepserve serve` as a real process: one-line flag errors; SIGTERM drains in-flight work and exits 0."""

from __future__ import annotations

import signal
import threading

import httpx
from server_helpers import GENERATIONS, assert_error_shape, decode_png, wait_until

from stepserve.commands.serve import main


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
    proc, url = early_cli_server.proc, early_cli_server.url
    try:
        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None

        assert wait_until(up, 120, 0.2) and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        results: list[httpx.Response] = []
        body = {"prompt": "in flight", "num_inference_steps": 40, "guidance_scale": 1.0, "seed": 3}
        workers = [threading.Thread(target=lambda: results.append(httpx.post(url + GENERATIONS, json=body,
                                                                             timeout=120))) for _ in range(3)]
        for w in workers:
            w.start()
        assert wait_until(lambda: httpx.get(url + "/health").json()["running"] == 3, 60)
        proc.send_signal(signal.SIGTERM)
        late = httpx.post(url + GENERATIONS, json=body, timeout=30)
        assert_error_shape(late, 503)
        assert httpx.get(url + "/health").status_code == 503
        for w in workers:
            w.join(120)
        assert [r.status_code for r in results] == [200, 200, 200], [r.text for r in results]
        assert all(decode_png(r.json()["data"][0]["b64_json"]).size == (16, 16) for r in results)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        early_cli_server.stop()
