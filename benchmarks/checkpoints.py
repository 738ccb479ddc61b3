"""Checkpoint formats side by side: the folder (float32), the denoiser as one .safetensors file, as GGUF Q8_0,
Q4_0 and Q6_K files, and quantized as it loads (`--quantize int8wo`, `int8dq`), on the embedded model (an SD
UNet) and the tiny Flux at its benchmark size (random weights, built in a temporary folder).

For each model x format: the weights' bytes (the file on disk; the denoiser's storage once loaded), how many of
the denoiser's parameters are held quantized (GGUF keeps a tensor whose rows are not whole blocks in float32;
torchao and diffusers' GGUF loader quantize Linear weights only), the peak resident memory (ru_maxrss) of a fresh
process that loads the format and serves one batch of --batch requests, images/s through the engine at batch 1
and at --batch (continuous batching, fixed steps), and the images' quality against the folder's float32 images
of the same requests (same seeds): PSNR, SSIM and, on the embedded model, the digit classifier's accuracy
(train-embedded's evaluation: does the image show the digit asked for?).

Every format of a model is loaded in this process; each round runs every format once at batch 1 and once at
--batch, the formats taking turns in an order that rotates between rounds, so that a busy machine weighs on all
alike. Speed is reported as each format's images/s over the folder's within a round, median over the rounds.

    .venv/bin/python benchmarks/checkpoints.py --rounds 5 --json bench-out/checkpoints.json

Prints a table per model and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from checkpoint_formats import (
    FORMATS,
    denoiser,
    denoiser_stats,
    file_bytes,
    load,
    peak_rss,
    write_files,
)

from stepserve import Engine, SamplingParams
from stepserve.bench.quality import PSNR_CAP_DB, psnr, ssim

MODELS = ("embedded", "tiny-flux")


def model_folder(name: str, root: Path) -> Path:
    if name == "embedded":
        from stepserve.pipelines.folder import resolve_model_path

        return resolve_model_path("embedded")
    from stepserve.tiny.flux import BENCH_OPTIONS, build_tiny_flux

    return build_tiny_flux(root / "tiny-flux", **BENCH_OPTIONS)


def requests(name: str, args) -> tuple[list[SamplingParams], list[int] | None]:
    """The requests every format serves (the model's defaults but for the steps), and the digit each should
    show (embedded: train-embedded's 20 evaluation prompts x --seeds)."""
    if name == "embedded":
        from stepserve.training.evaluate import eval_prompts

        seeds = range(args.seeds)
        params = [SamplingParams(prompt=text, seed=1000 * s + i, num_inference_steps=args.embedded_steps)
                  for s in seeds for i, (text, _) in enumerate(eval_prompts())]
        return params, [d for _ in seeds for _, d in eval_prompts()]
    params = [SamplingParams(prompt=f"a lighthouse on a cliff, {i}", seed=7 * i + 1,
                             num_inference_steps=args.flux_steps) for i in range(args.flux_images)]
    return params, None


def timed(engine: Engine, params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    results = engine.generate(params)
    elapsed = time.perf_counter() - start
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(bad[0])
    return len(params) / elapsed, results


def measure_model(name: str, args, root: Path) -> dict:
    folder = model_folder(name, root)
    formats = [f for f in FORMATS if f in args.formats.split(",")]
    if formats[0] != "folder":
        formats.insert(0, "folder")  # the reference
    files = write_files(folder, root / f"{name}-files", formats)
    params, digits = requests(name, args)
    steps = params[0].num_inference_steps
    rows = {fmt: {"format": fmt, "file_bytes": file_bytes(folder, fmt, files[fmt])} for fmt in formats}
    failed: dict[str, str] = {}
    runs: dict[str, list[dict]] = {fmt: [] for fmt in formats}
    for k in range(args.rss_repeats):  # first, while nothing else of this run is loaded: each in a fresh process
        for fmt in formats[k % len(formats):] + formats[:k % len(formats)]:
            runs[fmt].append(peak_rss(folder, fmt, files[fmt], steps, args.batch, args.threads))
            print(f"{name} {fmt}: resident memory {runs[fmt][-1]}", flush=True)
    for fmt in formats:
        rows[fmt]["rss"] = rss_summary(runs[fmt])
    engines: dict[str, dict[int, Engine]] = {}
    for fmt in formats:
        try:
            executor = load(folder, fmt, files[fmt])
        except Exception as exc:  # noqa: BLE001  (a format that does not load is a result)
            failed[fmt] = f"{type(exc).__name__}: {exc}"
            print(f"{name} {fmt}: does not load: {failed[fmt]}", flush=True)
            continue
        rows[fmt].update(denoiser_stats(denoiser(executor)))
        engines[fmt] = {b: Engine(executor, strategy="continuous", max_batch_size=b) for b in (1, args.batch)}
        for b, engine in engines[fmt].items():
            engine.generate([SamplingParams(prompt=f"warm up {i}", seed=i, num_inference_steps=2)
                             for i in range(b)])
    loaded = [f for f in formats if f in engines]
    rates = {(f, b): [] for f in loaded for b in (1, args.batch)}
    images: dict[str, list] = {}
    for k in range(args.rounds):
        for fmt in loaded[k % len(loaded):] + loaded[:k % len(loaded)]:
            for b in ((1, args.batch) if k % 2 == 0 else (args.batch, 1)):
                rate, results = timed(engines[fmt][b], params[:args.b1_requests] if b == 1 else params)
                rates[fmt, b].append(rate)
                if b != 1:
                    images[fmt] = [r.image for r in results]  # the same in every round
            print(f"{name} round {k + 1}/{args.rounds} {fmt}: batch 1 {rates[fmt, 1][-1]:.2f} img/s, "
                  f"batch {args.batch} {rates[fmt, args.batch][-1]:.2f} img/s", flush=True)
    clf = None
    if digits is not None:
        from stepserve.training.evaluate import digit_classifier, image_to_8x8

        clf = digit_classifier()
    reference = images.get("folder")
    for fmt in loaded:
        row = rows[fmt]
        for b in (1, args.batch):
            row[f"images_per_s_b{b}"] = statistics.median(rates[fmt, b])
            if reference is not None:
                row[f"vs_folder_b{b}"] = statistics.median(
                    [x / y for x, y in zip(rates[fmt, b], rates["folder", b])])
        if reference is not None:
            pairs = list(zip(images[fmt], reference))
            row["psnr_db"] = float(np.mean([min(psnr(a, b), PSNR_CAP_DB) for a, b in pairs]))
            row["ssim"] = float(np.mean([ssim(a, b) for a, b in pairs]))
            row["max_pixel_diff"] = int(max(np.abs(np.asarray(a.convert("RGB"), dtype=np.int16)
                                                   - np.asarray(b.convert("RGB"), dtype=np.int16)).max()
                                            for a, b in pairs))
        if clf is not None:
            row["accuracy"] = float((clf.predict(np.stack([image_to_8x8(i) for i in images[fmt]])) == digits).mean())
    for fmt, reason in failed.items():
        rows[fmt]["error"] = reason
    del engines
    gc.collect()
    return {"model": name, "steps": steps, "images": len(params), "batch1_images": args.b1_requests,
            "rows": [rows[f] for f in formats]}


def rss_summary(runs: list[dict]) -> dict:
    """Medians over the fresh processes (and the peak's range), or the first error."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    out["peak_range_mb"] = [min(r["peak_mb"] for r in runs), max(r["peak_mb"] for r in runs)]
    out["grown_mb"] = statistics.median(r["served_mb"] - r["imported_mb"] for r in runs)
    return out


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def print_table(result: dict, batch: int) -> None:
    print(f"\n{result['model']}: {result['steps']} steps, {result['images']} images at batch {batch}, "
          f"{result['batch1_images']} at batch 1")
    head = (f"{'format':12} {'file MB':>8} {'loaded MB':>9} {'quantized':>18} {'peak RSS (range)':>16} {'+load':>7} "
            f"{'img/s b1':>9} {'x':>6} {f'img/s b{batch}':>9} {'x':>6} {'PSNR':>6} {'SSIM':>6} {'acc':>6}")
    print(head)
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['format']:12} {_mb(r['file_bytes']):>8} does not load: {r['error'][:150]}")
            continue
        rss = r["rss"]
        quant = f"{r['quantized_params']:,}/{r['params']:,}"
        peak = "{:.0f} ({:.0f}-{:.0f})".format(rss["peak_mb"], *rss["peak_range_mb"]) if "peak_mb" in rss else "error"
        extra = f"{rss['grown_mb']:.1f}" if "peak_mb" in rss else "-"
        acc = f"{r['accuracy']:.1%}" if "accuracy" in r else "-"
        print(f"{r['format']:12} {_mb(r['file_bytes']):>8} {_mb(r['module_bytes']):>9} {quant:>18} {peak:>16} "
              f"{extra:>7} {r['images_per_s_b1']:9.2f} {r['vs_folder_b1']:5.2f}x "
              f"{r[f'images_per_s_b{batch}']:9.2f} {r[f'vs_folder_b{batch}']:5.2f}x {r['psnr_db']:6.1f} "
              f"{r['ssim']:6.3f} {acc:>6}")
        if "error" in rss:
            print(f"  (peak RSS child failed: {rss['error'][:200]})")
    print("(peak RSS: ru_maxrss in MB of a fresh process that loads the format and serves one batch, median and "
          "range over the processes; +load: its RSS after serving over its RSS after the imports, median; PSNR of "
          f"an identical image counts as {PSNR_CAP_DB:g} dB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="the larger batch (and the RSS process's one batch)")
    p.add_argument("--b1-requests", type=int, default=8, help="requests served one at a time per round")
    p.add_argument("--seeds", type=int, default=4, help="embedded: seeds per evaluation prompt (20 prompts)")
    p.add_argument("--embedded-steps", type=int, default=15)
    p.add_argument("--flux-steps", type=int, default=8)
    p.add_argument("--flux-images", type=int, default=16)
    p.add_argument("--rss-repeats", type=int, default=3, help="fresh processes per format for resident memory")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = {"rounds": args.rounds, "threads": args.threads, "batch": args.batch, "torch": torch.__version__,
           "models": []}
    with tempfile.TemporaryDirectory(prefix="checkpoints-") as tmp:
        for name in args.models.split(","):
            if name not in MODELS:
                raise SystemExit(f"--models: {name!r}; allowed: {', '.join(MODELS)}")
            out["models"].append(measure_model(name, args, Path(tmp)))
    for result in out["models"]:
        print_table(result, args.batch)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
