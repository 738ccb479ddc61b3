"""`stepserve tiny KIND --out DIR`: write a tiny diffusers folder with random weights (stepserve.tiny), to try a
model family, the server or the bench without downloading anything. It serves noise, quickly.

    stepserve tiny sdxl --out tiny-sdxl && stepserve serve --model tiny-sdxl
    stepserve tiny flux-dev --out tiny-flux --bench-size    # the size the benchmarks use (compute-bound on a CPU)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
import warnings
from pathlib import Path

from .flags import DefaultsHelpFormatter, OneLineParser

# KIND: (module of stepserve.tiny, keyword options of its builder)
KINDS = {
    "sd": ("sd", {}),
    "sd-v": ("sd", {"prediction_type": "v_prediction", "scheduler": "EulerDiscreteScheduler"}),
    "sd-inpainting": ("sd", {"inpainting": True}),
    "sdxl": ("sdxl", {}),
    "sd3": ("sd3", {}),
    "sd3-no-t5": ("sd3", {"with_t5": False}),
    "sd3.5": ("sd3", {"variant": "sd3.5", "dynamic_shifting": True}),
    "flux-dev": ("flux", {"variant": "dev"}),
    "flux-schnell": ("flux", {"variant": "schnell"}),
    "flux-fill": ("flux", {"variant": "dev", "fill": True}),
    "qwenimage": ("qwenimage", {}),
    "flux2-klein": ("flux2", {}),
    "flux2-klein-distilled": ("flux2", {"distilled": True}),
    "flux2-dev": ("flux2", {"variant": "dev"}),
    "wan": ("wan", {}),
    "wan2.2": ("wan", {"wan22": True}),
}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="stepserve tiny", description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("kind", choices=KINDS, help="model family (and variant) of the folder")
    p.add_argument("--out", type=Path, required=True, help="folder to write (created; must not hold a model yet)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--bench-size", action="store_true",
                   help="the larger size the benchmarks use (the module's BENCH_OPTIONS), not the test size")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if (args.out / "model_index.json").exists():
        p.error(f"--out: {args.out} already holds a model (model_index.json); give an empty or new folder")
    family, options = KINDS[args.kind]
    module = importlib.import_module(f"stepserve.tiny.{family}")
    if args.bench_size:
        options = {**options, **getattr(module, "BENCH_OPTIONS", {})}
    t0 = time.monotonic()
    try:
        with quiet():
            path = getattr(module, f"build_tiny_{family}")(args.out, seed=args.seed, **options)
    except OSError as exc:
        p.error(f"--out: cannot write {args.out}: {exc.strerror or exc}")
    print(f"stepserve tiny: wrote a {args.kind} folder with random weights to {path} in "
          f"{time.monotonic() - t0:.1f} s; serve it with `stepserve serve --model {path}`", file=sys.stderr)
    return 0


class quiet:
    """Without the libraries' chatter while a folder is written: transformers' and diffusers' warnings (e.g.
    about torchvision) and their progress bars ("Writing model shards")."""

    def __enter__(self) -> None:
        import diffusers
        import transformers

        self._saved = (transformers.logging.get_verbosity(), diffusers.utils.logging.get_verbosity())
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)

    def __exit__(self, *exc) -> None:
        import diffusers
        import transformers

        logging.disable(logging.NOTSET)
        self._warnings.__exit__(*exc)
        transformers.logging.set_verbosity(self._saved[0])
        transformers.logging.enable_progress_bar()
        diffusers.utils.logging.set_verbosity(self._saved[1])
        diffusers.utils.logging.enable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
