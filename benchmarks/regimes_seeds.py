"""The simulated regime matrix on several traces: one Poisson trace per seed, every cell judged by the issue's test
as benchmarks/regimes.py judges it, then counted over the seeds. One seed's matrix turns on a few requests near
the margins; the counts over ten are what a change to the default's rules is judged by.

    python benchmarks/regimes_seeds.py [--seeds 0-9] [--regimes cpu-tinyflux,gpu-1024] [--json seeds.json]

Prints, per seed, the cells within the margins and the cells where the default is >= 10% better than every fixed
alternative, then the totals and every cell that missed (regime, load, deadline, seed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import regimes  # noqa: E402  (the matrix itself)
import regimes_report  # noqa: E402


def seeds(text: str) -> list[int]:
    """'0-9' or '0,3,5'."""
    if "-" in text:
        first, last = (int(x) for x in text.split("-"))
        return list(range(first, last + 1))
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0-9", help="'0-9' or '0,3,5' (default 0-9)")
    p.add_argument("--regimes", default=",".join(regimes.REGIMES), help="simulated regimes only")
    p.add_argument("--json", type=Path, help="write the totals and every seed's verdict per cell to this file")
    args = p.parse_args(argv)
    total = {"within": 0, "better": 0, "cells": 0}
    misses, out, standing = [], {}, {}  # standing: per contender, the cells within the margins of the best
    for seed in seeds(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "rows.json"
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                regimes.main(["--regimes", args.regimes, "--seed", str(seed), "--json", str(path)])
            rows = json.loads(path.read_text())["rows"]
        text, within, better, n = regimes_report.verdict(rows)
        for name, count in regimes_report.standings(rows).items():
            standing[name] = standing.get(name, 0) + count
        out[seed] = text.splitlines()[2:]  # the verdict per cell (the rows of seed 0 are docs/regimes.json)
        total["within"] += within
        total["better"] += better
        total["cells"] += n
        misses += [f"{line.split(' | ')[0][2:]} {line.split(' | ')[1]} {line.split(' | ')[2]} (seed {seed})"
                   for line in text.splitlines()[2:] if line.split(" | ")[6].startswith("no")]
        print(f"seed {seed}: within the margins {within} of {n}; >=10% better than every fixed alternative {better}",
              flush=True)
    print(f"\ntotal: within the margins {total['within']} of {total['cells']}; >=10% better than every fixed "
          f"alternative {total['better']} of {total['cells']}")
    print("missed: " + ("; ".join(misses) if misses else "none"))
    print("within the margins of the best, per contender: " + ", ".join(
        f"{name} {count}" for name, count in sorted(standing.items(), key=lambda kv: -kv[1])))
    if args.json:
        args.json.write_text(json.dumps({"argv": argv if argv is not None else sys.argv[1:], "totals": total,
                                         "standings": standing, "misses": misses, "verdicts": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
