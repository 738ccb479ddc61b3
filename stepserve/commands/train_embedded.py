"""`stepserve train-embedded`: retrain the embedded default model from scikit-learn's digits
(stepserve/training/embedded.py; docs/EMBEDDED_MODEL.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from ..training.embedded import DEFAULT_OUT
    from .flags import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, prog="stepserve train-embedded",
                                 description="Retrain the embedded default model from scikit-learn's digits.")
    out = ap.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", type=Path, help="output model folder (serve it with --model FOLDER)")
    out.add_argument("--replace-embedded", dest="out", action="store_const", const=DEFAULT_OUT,
                     help=f"write over the shipped embedded model ({DEFAULT_OUT}), which every command and "
                          f"documented number uses")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights' initialisation and data order")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (fixed for determinism; 1 is also fastest on a busy machine)")
    ap.add_argument("--vae-steps", type=int, default=800, help="VAE steps (batch 32)")
    ap.add_argument("--unet-steps", type=int, default=1800, help="UNet (and text encoder) training steps")
    ap.add_argument("--batch", type=int, default=64, help="UNet batch size")
    ap.add_argument("--lr", type=float, default=2e-3, help="UNet/text-encoder peak learning rate")
    ap.add_argument("--aug-copies", type=int, default=8, help="augmented copies of the data encoded to latents")
    ap.add_argument("--reuse-vae", action="store_true", help="keep the VAE already in --out (skip stage 1)")
    ap.add_argument("--no-eval", action="store_true", help="skip the classifier-agreement measurement")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..training.embedded import train

    return train(args)


if __name__ == "__main__":
    sys.exit(main())
