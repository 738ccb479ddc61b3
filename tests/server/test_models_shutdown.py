"""`stepserve serve` of several models as a real process: SIGTERM drains every model (the requests sent are answered,
a request after it is refused) and the process exits 0."""

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from server_helpers import GENERATIONS, free_port, up_or_gone, wait_until

HANG_S = 240  # bounds a hang only


@pytest.mark.slow  # a real process of two models: about 20 s
def test_sigterm_drains_every_model_and_exits_0(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "stepserve.cli", "serve", "--model", "a=embedded", "--model",
                             "b=embedded", "--port", port, "--state", "memory", "--no-memory-cap",
                             "--strategy", "continuous", "--shutdown-grace-s", "120"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(up_or_gone(url, proc), HANG_S, 0.2) and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        results: dict[str, httpx.Response] = {}

        def send(model: str) -> None:
            results[model] = httpx.post(url + GENERATIONS, timeout=HANG_S, json={
                "model": model, "prompt": "seven", "num_inference_steps": 200, "guidance_scale": 1.0, "n": 8})

        workers = [threading.Thread(target=send, args=(m,)) for m in "ab"]
        for w in workers:
            w.start()
        wait_until(lambda: all(m["running"] or m["queue_depth"] for m in
                               httpx.get(url + "/health", timeout=30).json()["models"].values()), HANG_S)
        proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.join(HANG_S)
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert {m: r.status_code for m, r in results.items()} == {"a": 200, "b": 200}
