"""The entry point of a worker rank of a parallel model: `python -m stepserve.engine.rank_worker HOST:PORT RANK
PARENT_PID`, started by stepserve/parallel/ranks.py with the connection's key on its stdin. It loads the model as
build_engine does (the model, then the add-on folders, without their memory bounds: rank 0's stores decide what is
loaded) and hands over to stepserve/parallel/worker.py."""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import replace
from multiprocessing.connection import Client


def _load(config, rank: int):
    from .loading import load_executor
    from .serving_addons import serve_addons

    if str(config.device).startswith("cuda"):
        config = replace(config, device=f"cuda:{rank}")
    executor = load_executor(config.model, config.device, config.dtype, config.backend, config.threads,
                             config.weights)
    serve_addons(executor, config, budgets={}, say=lambda line: None)
    return executor


def main(argv: list[str]) -> None:
    from ..parallel.processes import die_with_parent
    from ..parallel.worker import run

    die_with_parent(int(argv[2]))
    # rank 0 ends a worker (its stop message, its pipe's end, its death): a signal sent to the whole process group
    # or cgroup (Ctrl-C in a terminal, a service manager's stop) must not end a rank while rank 0 drains its work
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # what a worker would log, rank 0 says (a worker's failure comes back to it): its stderr is the server's
    logging.getLogger("stepserve").addHandler(logging.NullHandler())
    host, port = argv[0].rsplit(":", 1)
    rank = int(argv[1])
    conn = Client((host, int(port)), authkey=bytes.fromhex(sys.stdin.readline().strip()))
    conn.send(rank)
    degrees, store_path, config, threads = conn.recv()
    import torch

    torch.set_num_threads(threads)
    run(conn, rank, degrees, store_path, config.device, lambda: _load(config, rank))


if __name__ == "__main__":
    main(sys.argv[1:])
