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
   eager and compiled forward.
A phase that would start after --budget-s is skipped and says so. Prints one table; writes --out/gpu_check.json.

    python benchmarks/gpu_check.py [--smoke] [--device cuda] [--dtype bfloat16] [--out gpu-check] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# runwayml/stable-diffusion-v1-5: unet/config.json, vae/config.json, text_encoder/config.json (CLIP ViT-L/14)
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, cross_attention_dim=768,
                 attention_head_dim=8, block_out_channels=(320, 640, 1280, 1280), norm_num_groups=32,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
SD15_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
                block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32, scaling_factor=0.18215)
SD15_TEXT = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
# black-forest-labs/FLUX.1-dev transformer/config.json
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
STRATEGIES = ("continuous", "dynamic", "static", "none")


def build_sd15(path: Path, dtype: torch.dtype, device: str) -> Path:
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from stepserve.tiny import clip_tokenizer

    torch.manual_seed(0)
    tokenizer = clip_tokenizer(77)
    with torch.device(device):  # random init on the device: seconds instead of minutes for 860M parameters
        text = CLIPTextModel(CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1,
                                            vocab_size=max(len(tokenizer), 49408), **SD15_TEXT))
        unet, vae = UNet2DConditionModel(**SD15_UNET), AutoencoderKL(**SD15_VAE)
    sched = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                          steps_offset=1, clip_sample=False, set_alpha_to_one=False)
    StableDiffusionPipeline(vae=vae.to(dtype), text_encoder=text.to(dtype), tokenizer=tokenizer,
                            unet=unet.to(dtype), scheduler=sched, safety_checker=None, feature_extractor=None,
                            requires_safety_checker=False).save_pretrained(path)
    return path


def build_tiny(path: Path) -> Path:
    from stepserve.tiny.sd import build_tiny_sd

    return build_tiny_sd(path)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int, warmup: int = 1) -> float:
    """Median seconds of fn() over `repeats` runs, the device synchronised around each."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def peak_flops(device: str, dtype: torch.dtype, smoke: bool) -> float:
    """FLOP/s of a large square matmul in `dtype` on the device: the peak utilisation is quoted against."""
    n = 512 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / timed(lambda: a @ b, device, repeats=3 if smoke else 10, warmup=2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


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
    from gpu_check_phases import run_phases

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
    for note in report["notes"]:
        print(f"- {note}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
