"""samples.png: the same requests (same prompts and seeds) as served under each strategy, one row per strategy,
with a caption that says how to read it, and the sentence report.md gives it: whether batching changed any image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CAPTION = ("Each row: one strategy; each column: one request, the same prompt and seed in every row (its steps "
           "above it).", "Identical rows: batching changed no image.")


@dataclass
class SampleSheet:
    path: Path
    strategies: list[str]  # the rows, top to bottom
    columns: int  # requests shown
    differing: list[str]  # strategies whose row differs from the first row's (pixel for pixel)


def write_samples(runs, path: Path, columns: int = 10) -> SampleSheet | None:
    """The sheet of the first repeat's runs (bench ContenderRuns with images), or None when they kept no images."""
    rows = [(r.metrics.contender, {s.index: s for s in r.images}) for r in runs if r.metrics.repeat == 0]
    common = sorted(set.intersection(*(set(images) for _, images in rows))) if rows else []
    picked = common[:columns]
    if not picked or not hasattr(rows[0][1][picked[0]].image, "size"):
        return None
    from PIL import Image, ImageDraw

    w, h = rows[0][1][picked[0]].image.size
    scale = max(1, 64 // max(w, h))
    label_w, cell, caption_h = 120, (w * scale + 4, h * scale + 4), 14 * len(CAPTION) + 6
    top = 16
    sheet = Image.new("RGB", (label_w + cell[0] * len(picked), top + cell[1] * len(rows) + caption_h), "white")
    draw = ImageDraw.Draw(sheet)
    for c, index in enumerate(picked):
        draw.text((label_w + c * cell[0] + 2, 2), f"{rows[0][1][index].spec.num_inference_steps} st", fill="black")
    for r, (name, images) in enumerate(rows):
        draw.text((4, top + r * cell[1] + cell[1] // 2 - 6), name, fill="black")
        for c, index in enumerate(picked):
            tile = images[index].image.convert("RGB").resize((w * scale, h * scale), Image.NEAREST)
            sheet.paste(tile, (label_w + c * cell[0] + 2, top + r * cell[1] + 2))
    for i, line in enumerate(CAPTION):
        draw.text((4, top + cell[1] * len(rows) + 4 + 14 * i), line, fill="black")
    sheet.save(path)
    first = rows[0][1]
    differing = [name for name, images in rows[1:]
                 if any(images[i].image.convert("RGB").tobytes() != first[i].image.convert("RGB").tobytes()
                        for i in picked)]
    return SampleSheet(path, [name for name, _ in rows], len(picked), differing)


def samples_section(sheet: SampleSheet) -> list[str]:
    """report.md's section on the sheet: what it shows and what it proves."""
    what = (f"One row per strategy ({', '.join(sheet.strategies)}), one column per request: the same {sheet.columns} "
            "requests (same prompts and seeds) as each strategy served them, in whatever batches it made.")
    if not sheet.differing:
        verdict = ("The rows are identical, pixel for pixel: batching changed no image (each request carries its own "
                   "timestep, sampler state and random generator).")
    else:
        verdict = (f"Rows that differ from {sheet.strategies[0]}'s, pixel for pixel: {', '.join(sheet.differing)}: "
                   "batching changed those images.")
    return ["## Sample images", "", f"![{CAPTION[0]} {CAPTION[1]}]({sheet.path.name})", "", what, "", verdict, ""]
