"""The LitServe peer: a LitAPI with LitServe's own batching (`LitAPI(max_batch_size=, batch_timeout=)`, the
LitServe 0.2.19 way), one inference worker on the CPU, one API server, served on 127.0.0.1 at stepserve's path.
decode_request checks each body alone (a bad one gets 400 and never joins a batch); predict runs the batch.

    python -m stepserve.bench.peers.litserve_peer --port P --wait-ms 10 --max-batch-size 8 ...

LitServe leaves its worker processes behind on SIGTERM; the bench kills them (process.py).
"""

from __future__ import annotations

import argparse
import sys

import litserve as ls
from fastapi import HTTPException

from .handler import IMAGES_PATH, BatchHandler, HandlerOptions, PeerRequestError, add_handler_args, options_from


class StepserveLitAPI(ls.LitAPI):
    def __init__(self, options: HandlerOptions, wait_s: float) -> None:
        super().__init__(max_batch_size=options.max_batch_size, batch_timeout=wait_s, api_path=IMAGES_PATH)
        self.options = options
        self.handler: BatchHandler | None = None

    def setup(self, device) -> None:
        self.handler = BatchHandler(self.options)

    def decode_request(self, request, **kwargs):
        try:
            return self.handler.parse(request)
        except PeerRequestError as exc:
            raise HTTPException(status_code=exc.status, detail=str(exc)) from None

    def batch(self, inputs):
        return list(inputs)

    def predict(self, x, **kwargs):
        if self.max_batch_size > 1:
            return self.handler.run(x)
        return self.handler.run([x])[0]  # LitServe calls predict per request when it does not batch

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output, **kwargs):
        if "error" in output:
            raise HTTPException(status_code=500, detail=output["error"]["message"])
        return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stepserve.bench.peers.litserve_peer")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--wait-ms", type=float, required=True, help="LitAPI batch_timeout, in ms")
    add_handler_args(p)
    args = p.parse_args(argv)
    api = StepserveLitAPI(options_from(args), args.wait_ms / 1000.0)
    # timeout=False: no request timeout of LitServe's own; deadlines are the load generator's business
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=False)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, log_level="warning", generate_client_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
