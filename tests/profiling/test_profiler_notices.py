"""The start-up memory check runs torch's profiler; what its native code prints to stderr that is not news stays
out of the log, also where the check runs on a thread other than the one that imported torch (a Ray Serve
replica builds its engine on such a thread, and kineto then printed 'ERROR: External init callback must run in
same thread as registerClient' in every replica's log)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, threading
import torch
from stepserve.engine.loading import load_executor
from stepserve.profiling import measure_peak_memory

executor = load_executor("embedded")
peaks = {}
thread = threading.Thread(target=lambda: peaks.update(measure_peak_memory(executor, [1])))
thread.start()
thread.join()
print("between the runs", file=sys.stderr, flush=True)  # a line of our own is passed on
assert peaks[1] > 0, peaks
print("measured", peaks[1])
"""


def test_the_memory_check_on_another_thread_leaves_no_profiler_notice_in_the_log():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("measured "), done.stdout
    assert "registerClient" not in done.stderr and "USDT" not in done.stderr, done.stderr
    assert "between the runs" in done.stderr
