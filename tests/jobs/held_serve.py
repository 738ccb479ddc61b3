"""`stepserve serve` as a real process that runs only its first STEPSERVE_TEST_STEPS denoising steps and holds every
later one (tests/step_gate.py): the restart test kills it while a job is in progress, whatever the machine's speed.

Run as `python tests/jobs/held_serve.py <serve flags>`, with STEPSERVE_TEST_STEPS set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for step_gate

from step_gate import SteppedExecutor

from stepserve.commands import serve


def main(argv: list[str]) -> int:
    start_engine = serve.start_engine

    def held_engine(config):
        engine = start_engine(config)
        gate = SteppedExecutor(engine.executor)
        engine.executor = engine.core.executor = gate
        gate.allow(int(os.environ["STEPSERVE_TEST_STEPS"]))
        return engine

    serve.start_engine = held_engine
    return serve.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
