"""`stepserve simulate`: replay a `stepserve bench` workload on a simulated clock, with the real policies and engine
and an executor that charges a measured latency model; writes the same results.json / report.md / plots.

    stepserve simulate --latency-model latency.json --steps 8,20,40 --rate-frac 0.7 --duration 30
    stepserve simulate --latency-model latency.json --load trace --trace trace.jsonl --strategies continuous,slo

Every `stepserve bench` flag about the workload, the contenders, the seed and the outputs means the same here,
so a bench command line becomes a simulate one by swapping the verb and `--model` for `--latency-model`. Flags
about where a model runs (--device, --dtype, --backend, --threads) are accepted and have no effect. A server
(--target) cannot be simulated; --sweep runs the bench's rate search on simulated runs. Time is simulated, so
--duration costs no waiting; the same --seed gives the same results (apart from the environment block).
Results go to sim-out/ by default (bench's go to bench-out/), and every output says it is simulated.
"""

from __future__ import annotations

import argparse
import math
import sys

from .bench import config_from_args, write_and_conclude
from .bench_flags import UsageError, build_parser
from .simulate_fleet import EPILOG as FLEET_EPILOG
from .simulate_fleet import FleetUsageError, split_fleet
from .simulate_models import EPILOG as MODELS_EPILOG
from .simulate_models import ModelsUsageError, split_models

# bench flags that mean nothing on a simulated clock: kept out of --help (--target and --model are refused, the
# others accepted and ignored so that a bench command line still runs)
NOT_HONOURED = ("--target", "--peers", "--api-key", "--model", "--device", "--dtype", "--backend", "--threads",
                "--transformer", "--unet", "--quantize", "--quantize-text", "--config",
                "--offload")
EPILOG = """simulate-only flags:
  --latency-model PATH  (required) the cost model every engine charges: a file from `stepserve profile`,
                        LatencyModel.save, or a bench run's latency_model.json
  --noise X             scale of the random spread of each charge, drawn (seeded by --seed) from the spread the
                        profile recorded: 0 (default) charges the model exactly, 1 the measured spread
"""


def _split_noise(argv: list[str]) -> tuple[list[str], float]:
    """--noise is the one flag bench lacks: take it out before the bench parser sees the rest."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--noise", default="0")
    known, rest = p.parse_known_args(argv)
    try:
        noise = float(known.noise)
    except ValueError:
        raise UsageError(f"--noise: {known.noise!r} is not a number") from None
    if not (math.isfinite(noise) and noise >= 0):
        raise UsageError(f"--noise: must be a number >= 0, got {known.noise}")
    return rest, noise


def parse(argv: list[str]):
    """(BenchConfig, noise, fleet settings, several models' flags or None) from a simulate command line; a bad
    flag raises UsageError with one line."""
    rest, noise = _split_noise(argv)
    try:
        rest, fleet = split_fleet(rest)
        rest, models = split_models(rest)
    except (FleetUsageError, ModelsUsageError) as exc:
        raise UsageError(str(exc)) from None
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        raise UsageError("--model: simulate runs no model; give --latency-model FILE (from `stepserve profile`)")
    cfg = config_from_args(rest, command="simulate")
    cfg.argv = ["simulate", *argv]
    if cfg.targets:
        raise UsageError("--target: a server cannot be simulated; give --latency-model FILE instead")
    if cfg.latency_model is None:
        raise UsageError("--latency-model FILE is required (a latency model from `stepserve profile`)")
    return cfg, noise, fleet, models


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        p = build_parser("stepserve simulate", __doc__)
        for flag in ("--latency-model",) + NOT_HONOURED:  # bench's wording (see the epilog), or no effect here
            p._option_string_actions[flag].help = argparse.SUPPRESS
        p.epilog = EPILOG + "\n" + MODELS_EPILOG + "\n" + FLEET_EPILOG
        p.print_help()
        return 0
    from ..costs.degree import devices_of
    from ..sim.bench import load_models, load_setup, run_simulation

    try:
        cfg, noise, fleet, models = parse(argv)
        setup = (load_setup(cfg.latency_model, noise) if models is None
                 else load_models(models.paths, models.weights, noise))
        if fleet.active:
            setup.fleet = fleet
            setup.source += f"; {fleet.describe(devices_of(setup.latency))}"
        if noise > 0:
            from ..sim.bench import make_executor

            make_executor(setup, cfg.seed)  # a model without a recorded spread fails here, before any run
        run = run_simulation(cfg, setup)
    except (UsageError, FileNotFoundError, ValueError) as exc:
        print(f"stepserve simulate: {exc}", file=sys.stderr)
        return 2
    return write_and_conclude(run, cfg.out)


if __name__ == "__main__":
    sys.exit(main())
