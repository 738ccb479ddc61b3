"""The fast path checked and measured on one machine in one command (scripts/gpu_check.sh on a GPU; --smoke on a CPU).

1. build: an SD-1.5-sized pipeline with random weights from the real configs (UNet 860M, VAE, CLIP ViT-L text
   encoder; written below, nothing downloaded), saved as a diffusers folder; --smoke: a tiny one;
2. numerics: half vs float32 and compiled vs eager denoiser outputs on the same rows (relative max error), and
   whether a row's output at a fixed shape changes when the rows are permuted (what --deterministic rests on);
3. compile: the denoiser compiled for every bucket (CUDA graphs on a GPU), warm-up timed;
4. profile: a latency model of the compiled engine (`stepserve simulate --latency-model` reads it);
5. bare vs engine: the bare compiled forward against the engine's step at the same rows, and model FLOP utilisation
   (FLOPs counted by torch's FlopCounterMode on one forward) against the device's peak (a timed matmul);
6. strategies: `stepserve bench`'s comparison on the compiled engine (images/s, p50/p95);
7. flux (when stepserve/pipelines/flux.py exists, a GPU, and time is left): a Flux.1-dev-sized transformer,
   eager and compiled forward;
8. parallel (two CUDA devices; --smoke: two CPU ranks): one request split over two devices (Ulysses, ring, tensor
   parallel on a tiny Flux.1, CFG parallel on a tiny SD) against one device: images and seconds
   (gpu_check_parallel.py).
A phase that would start after --budget-s is skipped and says so. Prints one table; writes --out/gpu_check.json.
The phases are in gpu_check_phases.py, the models in gpu_models.py.

    python benchmarks/gpu_check.py [--smoke] [--device cuda] [--dtype bfloat16] [--out gpu-check] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_check_phases import run_phases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (what the test suite runs)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="a phase that would not finish within this many seconds is skipped (not with --smoke)")
    ap.add_argument("--compile-backend", default="inductor", help="inductor | aot_eager (smoke tests)")
    ap.add_argument("--bench-duration", type=float, default=None, help="seconds per strategy run")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    args.out.mkdir(parents=True, exist_ok=True)
    report = run_phases(args, device, dtype)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    failed = [c for c in report["checks"] if not c["ok"]]
    return 1 if failed else 0


def print_table(report: dict) -> None:
    env = report["environment"]
    print(f"\n== gpu_check: {env['model']} on {env['device_name']} ({env['dtype']}), peak "
          f"{env['peak_tflops']:.3g} TFLOP/s (timed matmul), {report['wall_s']:.0f} s ==")
    print(f"{'check':<58}{'value':>10}{'limit':>8}  ok")
    for c in report["checks"]:
        print(f"{c['name']:<58}{c['value']:>10.3g}{c['limit']:>8.0e}  {'yes' if c['ok'] else 'NO'}")
    if report.get("forward"):
        print(f"\n{'rows':>5}{'bare ms':>10}{'engine ms':>11}{'engine/bare':>13}{'img/s (step)':>14}{'MFU':>8}")
        for f in report["forward"]:
            print(f"{f['rows']:>5}{f['bare_s'] * 1e3:>10.2f}{f['engine_s'] * 1e3:>11.2f}{f['engine_over_bare']:>12.2f}x"
                  f"{f['images_per_s_step']:>14.1f}{f['mfu']:>8.1%}")
    if report.get("strategies"):
        print(f"\n{'strategy':<14}{'images/s':>10}{'p50 ms':>10}{'p95 ms':>10}{'mean batch':>12}")
        for s in report["strategies"]:
            p50, p95 = (f"{v * 1e3:.0f}" if v is not None else "-" for v in (s["p50_s"], s["p95_s"]))
            print(f"{s['strategy']:<14}{s['images_per_s']:>10.2f}{p50:>10}{p95:>10}{s['mean_batch']:>12.1f}")
    if report.get("parallel"):
        print(f"\n{'split over 2 devices':<22}{'max diff':>10}{'1 device s':>12}{'split s':>10}{'speedup':>9}")
        for r in report["parallel"]:
            print(f"{r['case']:<22}{r['max_uint8_diff']:>10}{r['one_device_s']:>12.3f}{r['split_s']:>10.3f}"
                  f"{r['speedup']:>8.2f}x")
    if report.get("weights"):
        done = [q for q in report["weights"] if "error" not in q]
        batches = [k.removeprefix("step_s_b") for k in (done[0] if done else {}) if k.startswith("step_s_b")]
        print(f"\n{'weights':<20}{'rel err':>10}" + "".join(f"{f'step b{b} / plain':>18}" for b in batches)
              + f"{'peak MB':>10}")
        for q in report["weights"]:
            if "error" in q:
                print(f"{q['type']:<20} not run: {q['error']}")
                continue
            ratios = [q[k] / q[f"unquantized_{k}"] for k in q if k.startswith("step_s_b")]
            peak = f"{q['peak_mb']:.0f}" if "peak_mb" in q else "-"
            print(f"{q['type']:<20}{q['rel_err_vs_unquantized']:>10.3g}" + "".join(f"{r:>17.2f}x" for r in ratios)
                  + f"{peak:>10}")
    for note in report["notes"]:
        print(f"- {note}")


if __name__ == "__main__":
    raise SystemExit(main())
