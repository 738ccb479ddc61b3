"""The worker processes of a parallel model: started by rank 0, watched, and stopped with it.

One process per extra rank (multiprocessing's spawn: a fresh interpreter, no copy of rank 0's threads). A worker
reads its stage messages from a pipe (waiting on a pipe has no timeout, so an idle server is fine) and meets the
other ranks in torch.distributed's collectives inside the forward (gloo on the CPU, NCCL on CUDA). A worker dies
with rank 0 (a thread that waits on rank 0's pidfd, and the pipe's end-of-file) and ignores SIGTERM and SIGINT (rank
0 alone ends it, after draining), and rank 0 learns of a worker's death from its process sentinel at once
(`Ranks.failure`, the `on_failure` callbacks)."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Listener, wait

from .degrees import Degrees
from .processes import (FOLDER_PREFIX, SENTINELS, RanksLost, accept, is_stopped, join, leave_group, sentinel,
                        sweep_folders)

__all__ = ["Ranks", "RanksLost", "STAGE_TIMEOUT"]

log = logging.getLogger("stepserve.parallel")
WORKER_MODULE = "stepserve.engine.rank_worker"  # a worker process's entry point (it loads as build_engine does)
STOPPED_S = 10  # a worker stopped (SIGSTOP, a debugger) this many seconds fails the model
# the longest a collective, or rank 0 for a worker's answer to a stage, waits for a rank (a whole video step fits): a
# worker stopped or stuck past it fails the model (as its death does at once)
STAGE_TIMEOUT = timedelta(minutes=5)


class Ranks:
    """Rank 0's view of the workers: their pipes, their processes, and why they stopped (None while they run)."""

    def __init__(self, degrees: Degrees, config, threads: int) -> None:
        self.degrees = degrees
        self.device_type = "cuda" if str(config.device).startswith("cuda") else "cpu"
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self._closing = False
        self._joined = False  # this process's torch.distributed group is ours (left again by close)
        sweep_folders()  # those of a rank 0 that died without closing
        self._folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")  # mode 0700: the rendezvous file
        self.store_path = os.path.join(self._folder, "store")
        self.pipes, self.processes = [], []
        try:
            self._start(config, threads)
        except BaseException as exc:  # none is left behind: the ones started are stopped
            self.close(timeout=2.0)
            if isinstance(exc, OSError):
                raise RanksLost(f"a worker rank could not start: {exc}") from None
            raise
        self._watcher = threading.Thread(target=self._watch, name="stepserve-ranks", daemon=True)
        self._watcher.start()

    def _start(self, config, threads: int) -> None:
        # each worker is a fresh interpreter (`python -m stepserve.engine.rank_worker`: nothing of this process's
        # threads or its __main__ is copied) that dials back here for its pipe
        key = secrets.token_bytes(32)
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            host, port = listener.address
            for rank in range(1, self.degrees.world):
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", WORKER_MODULE, f"{host}:{port}", str(rank), str(os.getpid())],
                    stdin=subprocess.PIPE, close_fds=True))
                self.processes[-1].stdin.write(key.hex().encode() + b"\n")  # not on the command line
                self.processes[-1].stdin.close()
            by_rank = {}
            for _ in self.processes:
                conn = accept(listener, self.processes)
                by_rank[conn.recv()] = conn
        self.pipes = [by_rank[rank] for rank in range(1, self.degrees.world)]
        for pipe in self.pipes:
            pipe.send((self.degrees, self.store_path, config, threads))

    def join_group(self) -> None:
        """Rank 0's side of torch.distributed's initialisation (the workers wait for it); raises RanksLost when a
        worker died before it."""
        self._check()
        join(0, self.degrees.world, self.store_path, self.device_type, STAGE_TIMEOUT)
        self._joined = True

    def send(self, message) -> None:
        """`message` to every worker. A worker that does not take it within STAGE_TIMEOUT (stopped, stuck: a large
        message fills its pipe) fails the model instead of blocking rank 0 for good."""
        self._check()
        error: list = []

        def send_all() -> None:
            try:
                for pipe in self.pipes:
                    pipe.send(message)
            except (OSError, EOFError, ValueError) as exc:
                error.append(exc)

        sender = threading.Thread(target=send_all, name="stepserve-ranks-send", daemon=True)
        sender.start()
        sender.join(STAGE_TIMEOUT.total_seconds())
        if sender.is_alive():
            self._lost(f"a worker rank did not take a stage message within {STAGE_TIMEOUT.total_seconds():g} s "
                       f"(stopped or stuck); this model's ranks cannot run another step: restart the server")
        elif error:
            self._lost(f"a worker rank's pipe closed ({error[0]})")
        self._check()

    def replies(self, timeout_s: float | None = STAGE_TIMEOUT.total_seconds()) -> list:
        """One reply from every worker (after a stage that answers); RanksLost when one dies meanwhile or does not
        answer within `timeout_s` (None: no limit; loading a model at start-up takes what it takes)."""
        out = []
        for rank, (pipe, p) in enumerate(zip(self.pipes, self.processes), start=1):
            try:
                ready = wait([pipe, sentinel(p)], timeout=timeout_s)
            except (OSError, ValueError):  # the watcher closed the pipes meanwhile: a rank died
                raise RanksLost(self.failure or "the ranks were stopped") from None
            if not ready:
                self._lost(f"worker rank {rank} (pid {p.pid}) did not answer within {timeout_s:g} s (stopped or "
                           f"stuck); this model's ranks cannot run another step: restart the server")
                self._check()
            if pipe in ready:
                try:
                    out.append(pipe.recv())
                    continue
                except (OSError, EOFError):
                    pass
            self._lost(self._death(rank, p))
            self._check()
        return out

    def step_failed(self, exc: BaseException) -> RanksLost:
        """Rank 0's forward raised while the other ranks may be inside it: none can go on. A collective whose peer
        died errors at once (gloo reads the closed socket), sometimes before the watcher has seen the death: a death
        within a second is named as the cause, else rank 0's own error."""
        if self._closing:  # shut down under a running step: the ranks were stopped on purpose
            return RanksLost(self.failure or "the ranks were stopped")
        if self.failure is None:
            dead = wait([sentinel(p) for p in self.processes], timeout=1.0)
            for rank, p in enumerate(self.processes, start=1):
                if sentinel(p) in dead:
                    self._lost(self._death(rank, p))
            self._lost(f"rank 0 failed a denoising step the other ranks had started: {type(exc).__name__}: {exc}")
        return RanksLost(self.failure)

    def _check(self) -> None:
        if self.failure is not None:
            raise RanksLost(self.failure)

    def _watch(self) -> None:
        """A worker's exit fails the model at once; so does one stopped (SIGSTOP, a debugger) for STOPPED_S: its
        peers would wait inside a collective until the group's timeout."""
        pending = {sentinel(p): (rank, p) for rank, p in enumerate(self.processes, start=1)}
        stopped: dict[int, int] = {}  # rank -> seconds seen stopped in a row
        while pending and not self._closing:
            for ended in wait(list(pending), timeout=1.0):
                rank, p = pending.pop(ended)
                if not self._closing:
                    self._lost(self._death(rank, p))
            for rank, p in [v for v in pending.values()]:
                stopped[rank] = stopped.get(rank, 0) + 1 if is_stopped(p.pid) else 0
                if stopped[rank] >= STOPPED_S and not self._closing:
                    self._lost(f"worker rank {rank} (pid {p.pid}) has been stopped for {STOPPED_S} s; this model's "
                               f"ranks cannot run another step: restart the server")

    def _death(self, rank: int, p) -> str:
        try:
            code = p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        note = ""
        pipe = self.pipes[rank - 1]
        try:  # a worker that failed on its own says why before it exits
            if pipe.poll():
                reply = pipe.recv()
                if isinstance(reply, tuple) and reply and reply[0] == "fatal":
                    note = f": {reply[1]}"
        except (OSError, EOFError):
            pass
        return f"worker rank {rank} (pid {p.pid}) {how}{note}; this model's ranks cannot run another step: restart " \
               f"the server"

    def _lost(self, why: str) -> None:
        if self.failure is not None or self._closing:
            return
        self.failure = why
        log.critical("%s", why)
        self._abort_collectives()
        for callback in list(self.on_failure):
            try:
                callback(why)
            except Exception:  # noqa: BLE001 - a listener's failure must not stop the others
                log.exception("a rank-failure listener failed")
        self.close(timeout=2.0)

    def _abort_collectives(self) -> None:
        """NCCL waits for a dead peer until the group's timeout: abort its communicators, so that rank 0's step
        raises now. gloo needs nothing (its collective errors as soon as the peer's socket closes) and has no abort."""
        if self.device_type != "cuda":
            return
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - best effort: the step then ends at the group's timeout
            log.exception("could not abort the ranks' collectives")

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker: ask, then kill (a worker ignores SIGTERM: rank 0 alone ends it); no process is left
        behind."""
        self._closing = True
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except (OSError, EOFError, ValueError):
                pass
        for p in self.processes:
            for stop, wait_s in ((None, timeout), (p.kill, 5)):
                if stop is not None and p.poll() is None:
                    stop()
                try:
                    p.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for pipe in self.pipes:
            pipe.close()
        for p in self.processes:
            fd = SENTINELS.pop(id(p), None)
            if fd is not None:
                os.close(fd)
        if self._joined:
            self._joined = False
            leave_group()
        shutil.rmtree(self._folder, ignore_errors=True)
