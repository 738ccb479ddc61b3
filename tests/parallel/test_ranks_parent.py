"""A worker rank exits when rank 0 dies, even by SIGKILL, and only then: not when the thread that started it ends
(Linux's parent-death signal would kill it then)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from rank_servers import ROOT, wait_gone

CHILD = """
import sys, time
from stepserve.parallel.processes import die_with_parent
die_with_parent(int(sys.argv[1]))
print("watching", flush=True)
print(sys.stdin.readline().strip(), flush=True)
time.sleep(600)
"""

PARENT = """
import os, subprocess, sys, threading
started = []
def start():  # as an engine built on a thread that then ends (a library user's, an actor's)
    started.append(subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE))
    assert started[0].stdout.readline() == b"watching\\n"  # the thread ends after the worker set up its watch
thread = threading.Thread(target=start)
thread.start()
thread.join()
child = started[0]
child.stdin.write(b"alive\\n")
child.stdin.flush()
print(child.pid, child.stdout.readline().decode().strip(), flush=True)
sys.stdin.readline()  # until the test kills this process
"""


def test_a_worker_outlives_the_thread_that_started_it_and_dies_with_its_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env, text=True)
    try:
        pid, *said = parent.stdout.readline().split()
        assert said == ["alive"], "the worker died with the thread that started it"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_gone([int(pid)])
    finally:
        parent.kill()
        parent.wait()
