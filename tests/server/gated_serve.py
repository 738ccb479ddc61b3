"""`stepserve serve` as a real process whose denoising steps wait until the test frees them: the first line on
stdin (or stdin closing) frees every step (tests/step_gate.py). The SIGTERM test holds requests in flight this way
for as long as it needs, however fast or busy the machine is.

Run as `python tests/server/gated_serve.py <serve flags>`."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for step_gate

from step_gate import SteppedExecutor

from stepserve.commands import serve


def main(argv: list[str]) -> int:
    start_engine = serve.start_engine

    def gated_engine(config):
        engine = start_engine(config)  # loaded and warmed up as `stepserve serve` does it
        gate = SteppedExecutor(engine.executor)
        engine.executor = engine.core.executor = gate
        threading.Thread(target=lambda: (sys.stdin.readline(), gate.free()), daemon=True).start()
        return engine

    serve.start_engine = gated_engine
    return serve.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
