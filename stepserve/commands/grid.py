"""`stepserve grid`: a sample grid (one row per prompt, one column per seed) from a model, as one PNG."""

from __future__ import annotations

import argparse
import sys

from PIL import Image, ImageDraw

from ..util.digits import DIGIT_PROMPTS
from .flags import DefaultsHelpFormatter


def make_grid(rows: list[list[Image.Image]], labels: list[str], scale: int = 3, label_w: int = 150) -> Image.Image:
    cell_w = rows[0][0].width * scale
    cell_h = rows[0][0].height * scale
    grid = Image.new("RGB", (label_w + cell_w * len(rows[0]), cell_h * len(rows)), "white")
    draw = ImageDraw.Draw(grid)
    for r, (images, label) in enumerate(zip(rows, labels)):
        draw.text((4, r * cell_h + cell_h // 2 - 6), label, fill="black")
        for c, image in enumerate(images):
            grid.paste(image.convert("RGB").resize((cell_w, cell_h), Image.NEAREST), (label_w + c * cell_w, r * cell_h))
    return grid


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, prog="stepserve grid",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded", help="embedded | a local diffusers folder")
    ap.add_argument("--prompts", default=None, help="comma-separated prompts (default: a handwritten zero..nine)")
    ap.add_argument("--seeds", type=int, default=6, help="columns: seeds 0..N-1")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    ap.add_argument("--sampler", default=None, help="sampler name (default: the model's)")
    ap.add_argument("--guidance-scale", type=float, default=None, help="classifier-free guidance (default: the model's)")
    ap.add_argument("--out", default="grid.png", help="the PNG to write")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")

    from ..api import Engine
    from ..request.types import SamplingParams
    from ..request.validation import ValidationError

    prompts = [p.strip() for p in args.prompts.split(",")] if args.prompts else list(DIGIT_PROMPTS)
    engine = Engine.from_pretrained(args.model, strategy="continuous", max_batch_size=16)
    params = [SamplingParams(prompt=p, seed=s, num_inference_steps=args.steps, sampler=args.sampler,
                             guidance_scale=args.guidance_scale) for p in prompts for s in range(args.seeds)]
    try:
        results = engine.generate(params, progress=True)
    except ValidationError as exc:
        print(f"stepserve grid: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"stepserve grid: {len(failed)} images failed: {failed[0].error}", file=sys.stderr)
        return 1
    rows = [[results[i * args.seeds + s].image for s in range(args.seeds)] for i in range(len(prompts))]
    make_grid(rows, prompts).save(args.out)
    print(f"wrote {args.out} ({len(prompts)} prompts x {args.seeds} seeds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
