"""The Triton peer: the classic repository (`stepserve export triton --mode classic`: Triton's dynamic batcher,
max_batch_size and max_queue_delay, in front of a BLS pipeline over the three networks in onnxruntime) served by
the tritonserver that ships with nvidia-pytriton (deploy/triton/server.py), on 127.0.0.1.

    python -m stepserve.bench.peers.triton_peer --repo DIR --http-port P --grpc-port G --metrics-port M \\
        --wait-ms 10 --max-batch-size 8 --ready-file F ...

The repository is written at start (part of the peer's start-up, not of any number). On SIGTERM it stops the
server and its stub processes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .handler import add_handler_args, options_from


def main(argv: list[str] | None = None) -> int:
    from ...deploy.onnx_cache import onnx_folder
    from ...deploy.triton.repository import RepositoryOptions, write_repository
    from ...deploy.triton.server import Ports, TritonServer

    p = argparse.ArgumentParser(prog="python -m stepserve.bench.peers.triton_peer")
    p.add_argument("--repo", type=Path, required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--wait-ms", type=float, required=True, help="the dynamic batcher's max_queue_delay, in ms")
    p.add_argument("--ready-file", type=Path, required=True)
    add_handler_args(p)
    args = p.parse_args(argv)
    options = options_from(args)
    if options.backend != "onnxruntime":
        print("triton peer: the classic layout runs the networks in onnxruntime only", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # the ONNX export the onnxruntime backend runs everywhere else (exported once into a cache): the same networks
    write_repository(onnx_folder(options.model), args.repo, RepositoryOptions(
        mode="classic", max_batch_size=options.max_batch_size, max_queue_delay_ms=args.wait_ms,
        threads=options.threads, validate=False), quiet=True)
    log = str(args.repo.parent / "tritonserver.log")
    server = TritonServer(args.repo, Ports(args.http_port, args.grpc_port, args.metrics_port), log, quiet=True)
    try:
        server.start()
        args.ready_file.write_text("ready\n")
        print(f"triton peer: serving {args.repo} (grpc 127.0.0.1:{args.grpc_port})", flush=True)
        while not stop.wait(0.5) and server.process is not None and server.process.poll() is None:
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
