"""samples.png: the same requests (same prompts and seeds) as served under each strategy, one row per strategy,
with a caption that says how to read it, and the sentence report.md gives it: whether batching changed any image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CAPTION = ("Each row: one strategy; each column: one request, the same prompt and seed in every row (its steps "
           "above it).", "Rows that look the same: batching changed no image (report.md gives the largest difference).")


@dataclass
class SampleSheet:
    path: Path
    strategies: list[str]  # the rows, top to bottom
    columns: int  # requests shown
    max_diff: dict[str, int]  # per strategy after the first: the largest difference from the first row's pixels


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
    import numpy as np

    def pixels(image):
        return np.asarray(image.convert("RGB"), dtype=np.int16)

    first = rows[0][1]
    max_diff = {name: max(int(np.abs(pixels(images[i].image) - pixels(first[i].image)).max()) for i in picked)
                for name, images in rows[1:]}
    return SampleSheet(path, [name for name, _ in rows], len(picked), max_diff)


def samples_section(sheet: SampleSheet) -> list[str]:
    """report.md's section on the sheet: what it shows and what it proves."""
    what = (f"One row per strategy ({', '.join(sheet.strategies)}), one column per request: the same {sheet.columns} "
            "requests (same prompts and seeds) as each strategy served them, in whatever batches it made.")
    first = sheet.strategies[0]
    exact = [n for n, d in sheet.max_diff.items() if d == 0]
    rounding = [n for n, d in sheet.max_diff.items() if d == 1]
    changed = [f"{n} (up to {d})" for n, d in sheet.max_diff.items() if d > 1]
    why = "each request carries its own timestep, sampler state and random generator"
    if not rounding and not changed:
        verdict = f"The rows are identical, pixel for pixel: batching changed no image ({why})."
    elif not changed:
        verdict = (f"Every row is within 1 of {first}'s in every pixel (8-bit values; identical: "
                   f"{', '.join(exact) or 'none'}; off by 1 somewhere: {', '.join(rounding)}): batching changed no "
                   f"image ({why}); CPU kernels round slightly differently at other batch sizes, and "
                   "`--deterministic` makes the images byte-identical.")
    else:
        verdict = (f"Rows that differ from {first}'s by more than 1 (8-bit values): {', '.join(changed)}: batching "
                   "changed those images, which it must not; please report it.")
    return ["## Sample images", "", f"![{CAPTION[0]} {CAPTION[1]}]({sheet.path.name})", "", what, "", verdict, ""]
