"""Write the GPU latency models that stepserve ships (stepserve/models/latency/gpu-*.json) from published figures.

This machine has no GPU, so these curves are not measured here: they are built from throughput figures published
by other serving projects, with every assumption written into each file's metadata (`source`, `figures`,
`assumptions`). They give the simulator (`stepserve simulate --latency-model FILE`) the cost regimes a GPU puts a
diffusion server in:

- gpu-512-sublinear.json: a 20B DiT (Qwen-Image) at 512x512 on an H200; batching pays (3.21x images/s at 16).
- gpu-1024-compute-bound.json: a 12B DiT (FLUX.1-dev scale) at 1024x1024 on an H100; a batch of n costs about
  n forwards (1.02x images/s at batch 2).
- gpu-sd15-512.json: an SD 1.5-class UNet at 512x512 on an A100-class GPU; a curve in between the two above.

Per-degree variants of the 1024x1024 curve (gpu-1024-compute-bound-ulysses{2,4,8}.json): one request split over
2, 4 or 8 GPUs with Ulysses sequence parallelism (`--ulysses-degree N`), from published scaling figures (see
`ulysses_figures`); the step curve is the one-device curve times the published step speed-up, encode and decode
as on one device (stepserve.costs.degree.at_degree).

The step curves are relative shapes from the published gains, scaled to an absolute batch-1 step time; what each
scale rests on is in the file. Only the main curves are written (no `by_guidance_rows`): the published figures are
images per second as each benchmark ran its requests, not split by guidance rows, so `guidance_rows` is left
unrecorded and every request is charged the curve at its request count, whatever its guidance_scale.

    python benchmarks/gpu_latency_models.py [--out stepserve/models/latency]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from stepserve.costs.degree import at_degree, parallel_entry
from stepserve.costs.latency_model import Curve, LatencyModel

ROOT = Path(__file__).resolve().parent.parent
MAX_BATCH = 16

SGLANG = ("SGLang diffusion, H200, Qwen-Image-2512, comment on sgl-project/sglang PR 22183: 1.82x images/s at "
          "batch 2 and about 3.21x at batch 16 at 512x512; 1.02x at batch 2 at 1024x1024")
VLLM_OMNI = "vLLM-Omni PR 2729, A100, Qwen-Image 1024x1024, 50 steps: 0.04 req/s at batch 1 and at batch 8"
XDIT = "xDiT docs (performance/flux.md): FLUX.1-dev 1024x1024, 28 steps, 4.30 s on one compiled H100"
VLLM_BLOG = "vLLM blog 2025-12-19: Qwen-Image 1024x1024 on H200, 20.0 s per image (no step cache)"

COMMON = [
    "Not measured: built from published throughput figures by benchmarks/gpu_latency_models.py; replace with "
    "`stepserve profile` on the real GPU when one is at hand.",
    "A gain g(n) (images/s at batch n over batch 1) becomes a step curve step(n) = step(1) * n / g(n).",
    "Guidance: the figures are per image as each benchmark ran it, not split by guidance rows; guidance_rows is "
    "left unrecorded (so every request is charged the curve at its request count) and no by_guidance_rows "
    "curves are written.",
    "Counts 1..16 are written at every batch size; past 16 the last segment is extended (LatencyModel's rule).",
]


def log_interp_gain(known: dict[int, float]):
    """g(n) linear in log2(n) between the known (batch size, gain) points, flat past the last one."""
    pts = sorted(known.items())

    def g(n: int) -> float:
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, g0), (n1, g1) in zip(pts, pts[1:]):
            if n <= n1:
                return g0 + (g1 - g0) * (math.log2(n) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
        return pts[-1][1]

    return g


def curve(fn) -> Curve:
    return Curve(tuple((n, round(fn(n), 6)) for n in range(1, MAX_BATCH + 1)))


def linear(fixed_s: float, per_item_s: float) -> Curve:
    return curve(lambda n: fixed_s + per_item_s * n)


def model(bucket, step1_s: float, gain, encode: Curve, decode: Curve, meta: dict) -> LatencyModel:
    step = curve(lambda n: step1_s * n / gain(n))
    meta = {**meta, "buckets": [list(bucket)],
            "batch_sizes": list(range(1, MAX_BATCH + 1)), "max_batch_size": MAX_BATCH,
            "gain_at": {str(n): round(gain(n), 4) for n in (1, 2, 4, 8, 16)},
            "guidance_curves": "main curves only (see assumptions)"}
    return LatencyModel(step={bucket: step}, encode=encode, decode={bucket: decode}, reference_bucket=bucket,
                        metadata=meta)


def gpu_512() -> LatencyModel:
    gain = log_interp_gain({1: 1.0, 2: 1.82, 16: 3.21})
    step1 = 0.39 / (4 / gain(4))  # batch 4 at 512x512 = the pixels of batch 1 at 1024x1024 (see assumptions)
    return model((512, 512), step1, gain, linear(0.035, 0.005), linear(0.0, 0.03), {
        "model": "qwen-image-class DiT (20B) at 512x512", "device": "GPU (H200, published)", "dtype": "bfloat16 (as published)",
        "regime": "sublinear: batching pays (3.21x images/s at batch 16)",
        "source": "published figures (see 'figures'); not measured on this machine",
        "figures": [SGLANG, VLLM_BLOG],
        "assumptions": COMMON + [
            "Gains between the published points (1: 1.0, 2: 1.82, 16: 3.21) are linear in log2(batch size): "
            "g(4) = 2.28, g(8) = 2.75 (the figure says the gain levels off near 3.21x at 16).",
            "Scale: the vLLM blog's 20.0 s for a 1024x1024 Qwen-Image on an H200 is taken as 50 steps of "
            "0.39 s (default step count; encode and decode assumed under 0.5 s). A 512x512 batch of 4 has the "
            "pixels of one 1024x1024 image, and at 1024x1024 the GPU is saturated (1.02x at batch 2), so "
            "step(4) at 512x512 is set to 0.39 s; step(1) = 0.39 s * g(4) / 4 = 0.22 s. Attention's extra "
            "cost at 1024x1024 is ignored, so the 512x512 steps are if anything slightly too slow.",
            "Encode (assumed, not published): a 7B text encoder on an H200, 35 ms + 5 ms per prompt.",
            "Decode (assumed, not published): VAE decode at 512x512 on an H200, 30 ms per image, linear in the "
            "batch (no batching gain).",
        ]})


def gpu_1024() -> LatencyModel:
    def gain(n: int) -> float:
        return 1.0 if n == 1 else 1.02

    return model((1024, 1024), 0.150, gain, linear(0.010, 0.010), linear(0.0, 0.080), {
        "model": "flux.1-dev-class DiT (12B) at 1024x1024", "device": "GPU (H100 scale, published)", "dtype": "bfloat16 (as published)",
        "regime": "compute-bound: a batch of n costs about n forwards (step(8) = 7.84 x step(1))",
        "source": "published figures (see 'figures'); not measured on this machine",
        "figures": [XDIT, SGLANG, VLLM_OMNI],
        "assumptions": COMMON + [
            "Shape: g(n) = 1.02 for every n >= 2 (SGLang's 1.02x at batch 2 at 1024x1024, H200). vLLM-Omni "
            "measured the same 0.04 req/s at batch 1 and 8 on an A100 (two significant digits, so within about "
            "+-12%); a flat 1.02 agrees with both and keeps the step curve increasing.",
            "Scale: xDiT's 4.30 s for 28 steps of FLUX.1-dev on one compiled H100 is 28 steps of 0.150 s plus "
            "0.10 s of encode and decode (below).",
            "Encode (assumed, not published): T5-XXL + CLIP text encoders on an H100, 10 ms + 10 ms per prompt.",
            "Decode (assumed, not published): VAE decode at 1024x1024 on an H100, 80 ms per image, linear in "
            "the batch (compute-bound like the denoiser).",
        ]})


def gpu_sd15() -> LatencyModel:
    g512 = log_interp_gain({1: 1.0, 2: 1.82, 16: 3.21})

    def gain(n: int) -> float:  # geometric mean of the 512x512 and 1024x1024 Qwen-Image gains
        return math.sqrt(g512(n) * (1.0 if n == 1 else 1.02))

    return model((512, 512), 0.025, gain, linear(0.004, 0.001), linear(0.0, 0.020), {
        "model": "sd-1.5-class UNet (0.86B) at 512x512, classifier-free guidance", "device": "GPU (A100 class)", "dtype": "float16 (assumed)",
        "regime": "in between: g(2) = 1.36, g(16) = 1.81",
        "source": "a curve chosen between the published 512x512 and 1024x1024 curves (see 'assumptions'); no "
                  "published SD 1.5 batch curve was used; not measured on this machine",
        "figures": [SGLANG],
        "assumptions": COMMON + [
            "Shape: no published SD 1.5 batching figure was at hand. At 512x512 SD 1.5 attends over a 64x64 "
            "latent (4096 positions at its first level, like the 4096 image tokens of a 1024x1024 DiT, which is "
            "compute-bound) with two guidance rows per request, but the model is about 20x smaller than "
            "Qwen-Image (which still gains 3.21x at 512x512). So the gain is taken in between, as the geometric "
            "mean of the two SGLang Qwen-Image gains at each batch size: g(n) = sqrt(g512(n) * g1024(n)); "
            "g(2) = 1.36, g(8) = 1.68, g(16) = 1.81.",
            "Scale (assumed, not published here): 25 ms per step at batch 1 (both guidance rows), so a 50-step "
            "image takes about 1.3 s on an A100-class GPU in fp16.",
            "Encode (assumed): CLIP ViT-L text encoder, 4 ms + 1 ms per prompt.",
            "Decode (assumed): VAE decode at 512x512, 20 ms per image, linear in the batch.",
        ]})


XDIT_USP = ("xDiT docs (performance/flux.md, 'Scalability of Flux.1 Dev'): FLUX.1-dev 1024x1024, 28 steps, 4xH100, "
            "torch.compile: 1 GPU 4.30 s, Ulysses-2 2.68 s, Ring-2 2.60 s, Ulysses-4 1.63 s (PyTorch eager: 6.71, "
            "4.38, 5.31, 4.24 s)")
VLLM_OMNI_SP = ("vLLM-Omni docs (user_guide/diffusion/sequence_parallel.md): Qwen-Image 2048x2048, 50 steps, H800, "
                "sdpa: 112.5 s on one GPU, Ulysses-SP 2: 65.2 s (1.73x), 4: 39.6 s (2.84x), 8: 30.8 s (3.65x)")
OVERHEAD_S = 0.10  # encode(1) + decode(1) of gpu_1024: the part of a published time that is not split


def ulysses_figures() -> dict[int, tuple[float, str]]:
    """Degree -> (its step time over one device's at 1024x1024, how that number was had)."""
    one = (4.30 - OVERHEAD_S) / 28  # 0.150 s: gpu_1024's step

    def measured(total_s: float) -> float:
        return (total_s - OVERHEAD_S) / 28 / one

    four = measured(1.63)
    eight = four * 30.8 / 39.6
    return {
        2: (measured(2.68), "measured: xDiT's Ulysses-2 (2.68 s) less encode and decode (0.10 s, not split), over "
                            "28 steps: 0.0921 s a step, 0.614 of one H100's 0.150 s"),
        4: (four, "measured: xDiT's Ulysses-4 (1.63 s) less encode and decode, over 28 steps: 0.0546 s a step, 0.364 "
                  "of one H100's (the often quoted 6.71 s -> 1.63 s, 4.12x, compares eager on one GPU with compiled on "
                  "four; compiled to compiled it is 2.64x on the whole image, 2.75x on the steps)"),
        8: (eight, "extrapolated: no published 8-GPU FLUX.1-dev time on H100s was found. The 4 -> 8 step is taken "
                   "from vLLM-Omni's Qwen-Image 2048x2048 Ulysses figures (39.6 s -> 30.8 s, x0.778): 0.0425 s a "
                   "step, 0.283 of one H100's. At 1024x1024 each of 8 ranks holds 512 image tokens (a quarter of "
                   "what it holds at 2048x2048), so communication weighs more and this is likely optimistic; a "
                   "fixed-overhead fit to xDiT's 2 and 4 (0.150 s / N + 0.017 s) would say 0.036 s, more so"),
    }


def gpu_1024_ulysses(degree: int) -> LatencyModel:
    scale, how = ulysses_figures()[degree]
    model = at_degree(gpu_1024(), scale, parallel_entry(ulysses=degree), figures=[XDIT_USP, VLLM_OMNI_SP],
                      assumptions=[
        f"Degree {degree}: one request split over {degree} GPUs with Ulysses sequence parallelism; a replica holds "
        f"{degree} devices.",
        f"Step speed-up: {how}.",
        "Batches at this degree keep the one-device curve's shape (a batch of n costs n / 1.02 batch-1 steps): no "
        "published figure gives a batch curve at a degree > 1. Each rank holds 1/N of every request's tokens, so "
        "at high degrees a GPU may not be saturated at batch 1 and batching may pay a little more than assumed.",
        "Encode and decode as on one device: stepserve splits the transformer only (the text encoders and the VAE "
        "run whole).",
    ])
    if how.startswith("extrapolated"):  # the file's headline says so, not only its assumptions
        model.metadata["source"] = "extrapolated from published figures of other degrees and models (see " \
                                   "'assumptions'); not measured"
    return model


MODELS = {"gpu-512-sublinear.json": gpu_512, "gpu-1024-compute-bound.json": gpu_1024, "gpu-sd15-512.json": gpu_sd15,
          **{f"gpu-1024-compute-bound-ulysses{n}.json": (lambda n=n: gpu_1024_ulysses(n)) for n in (2, 4, 8)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "stepserve" / "models" / "latency")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, build in MODELS.items():
        path = args.out / name
        build().save(path)
        m = LatencyModel.load(path)
        ratios = ", ".join(f"step({n})/step(1) {m.step_s(n) / m.step_s(1):.2f}" for n in (2, 8, 16))
        print(f"{path}: step(1) {m.step_s(1) * 1000:.0f} ms; {ratios}")


if __name__ == "__main__":
    main()
