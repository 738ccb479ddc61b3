"""The process plumbing of a parallel model's ranks (ranks.py): joining torch.distributed, a worker's watch on its
rank 0, the pidfds rank 0 waits on, the rendezvous folders, and a stopped process's state. Linux only (pidfd, /proc).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import tempfile
import subprocess
import threading
from multiprocessing.connection import Listener

log = logging.getLogger("stepserve.parallel")
FOLDER_PREFIX = "stepserve-ranks-"  # + rank 0's pid: a rendezvous folder (mode 0700)


class RanksLost(BaseException):
    """A worker rank died or diverged: the model cannot run another step. A BaseException, so that the engine core
    does not retry it request by request (stages.py isolates Exceptions) and the engine reports itself failed."""


def join(rank: int, world: int, store_path: str, device_type: str, timeout) -> None:
    """Join torch.distributed's group: the rendezvous is a file in a folder only this user reads (no port: nothing
    listens on the network for it, and two models starting at once cannot take each other's port), and gloo's and
    NCCL's own sockets stay on the loopback interface unless the environment says otherwise (all ranks are on this
    machine)."""
    import torch.distributed as dist

    if device_type == "cuda":  # rank r on CUDA device r (diffusers' hooks place it there too)
        import torch

        torch.cuda.set_device(rank)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout)



def leave_group() -> None:
    """Rank 0 leaves torch.distributed's group (its workers are gone), so that another parallel engine can start in
    this process later (a test suite's, a benchmark's)."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a group broken by a dead rank may fail to close; it is left behind
        log.debug("leaving the process group failed", exc_info=True)


def die_with_parent(parent: int) -> None:
    """This process exits as soon as `parent` (the rank 0 that started it) dies, even by SIGKILL: a thread waits on
    its pidfd. Not Linux's parent-death signal: that one follows the thread that started the process, so the ranks
    of an engine built on a thread that then ends (a library user's, an actor's) would die with that thread."""
    try:
        fd = os.pidfd_open(parent)
    except OSError:  # gone already
        os._exit(1)
    if os.getppid() != parent:  # it died (and its pid was reused) before the pidfd was opened
        os._exit(1)

    def watch() -> None:
        select.select([fd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="stepserve-parent", daemon=True).start()


def sweep_folders() -> None:
    """Remove this user's rendezvous folders whose rank 0 (the pid in the name) is gone."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if name.startswith(FOLDER_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            path = os.path.join(root, name)
            if os.path.isdir(path) and os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal or traced (Linux's /proc state T or t)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


SENTINELS: dict[int, int] = {}  # id(Popen) -> its pidfd, closed by Ranks.close


def sentinel(p: subprocess.Popen) -> int:
    """A file descriptor that becomes readable when `p` exits (Linux's pidfd), for multiprocessing's wait()."""
    if id(p) not in SENTINELS:
        SENTINELS[id(p)] = os.pidfd_open(p.pid)
    return SENTINELS[id(p)]


def accept(listener: Listener, processes: list) -> object:
    """The next worker's connection; RanksLost when a worker exits before it dials back."""
    done = threading.Event()
    box: list = []

    def accept() -> None:
        try:
            box.append(listener.accept())
        except OSError as exc:
            box.append(exc)
        done.set()

    threading.Thread(target=accept, daemon=True).start()
    while not done.wait(0.2):
        for rank, p in enumerate(processes, start=1):
            if p.poll() is not None:
                listener.close()
                raise RanksLost(f"worker rank {rank} (pid {p.pid}) exited with code {p.returncode} before it "
                                f"started")
    if isinstance(box[0], OSError):
        raise RanksLost(f"a worker rank could not connect: {box[0]}")
    return box[0]
