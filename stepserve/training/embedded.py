"""Train stepserve's embedded default model: a tiny Stable-Diffusion-shaped digit generator.

Stage 1 trains a small AutoencoderKL on upscaled scikit-learn digits (32x32 -> 4x8x8 latents); stage 2 trains a
UNet2DConditionModel jointly with a from-scratch CLIPTextModel on digit prompts, with prompt dropout for
classifier-free guidance. The result is a diffusers StableDiffusionPipeline folder plus ``stepserve.json``.

    stepserve train-embedded --out stepserve/models/embedded
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..util.progress import progress
from . import data

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "models" / "embedded"
SCHEDULER_CONFIG = {
    "_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "prediction_type": "epsilon", "clip_sample": False, "set_alpha_to_one": False,
    "steps_offset": 1, "timestep_spacing": "leading",
}
SERVING = {"default_sampler": "dpmpp_2m", "default_steps": 15, "default_guidance_scale": 3.0}


def build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                         up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                         layers_per_block=1, latent_channels=4, norm_num_groups=16, sample_size=32)


def build_text_encoder(vocab_size: int, max_length: int, bos: int, eos: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=max_length, projection_dim=64,
                         bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    return CLIPTextModel(cfg)


def build_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        mid_block_type=None, cross_attention_dim=64, attention_head_dim=32, norm_num_groups=16)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def train_vae(vae, images: torch.Tensor, steps: int, gen: torch.Generator, batch: int = 32, lr: float = 2e-3,
              kl_weight: float = 1e-4) -> dict:
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    vae.train()
    bar = progress(steps, "vae", "step", dynamic_ncols=True)
    rec_avg = kl_avg = None
    for step in range(steps):
        set_lr(opt, lr_at(step, steps, lr, 200))
        idx = torch.randint(0, len(images), (batch,), generator=gen)
        x = data.augment(images[idx], gen)
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        rec_loss = F.mse_loss(rec, x) + 0.5 * F.l1_loss(rec, x)
        kl = 0.5 * (post.mean.pow(2) + post.var - 1 - post.logvar).mean()
        loss = rec_loss + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        rec_avg = rec_loss.item() if rec_avg is None else 0.98 * rec_avg + 0.02 * rec_loss.item()
        kl_avg = kl.item() if kl_avg is None else 0.98 * kl_avg + 0.02 * kl.item()
        bar.set_postfix(rec=f"{rec_avg:.4f}", kl=f"{kl_avg:.2f}")
        bar.update(1)
    bar.close()
    vae.eval()
    return {"vae_recon_loss": rec_avg, "vae_kl": kl_avg}


@torch.no_grad()
def encode_dataset(vae, images: torch.Tensor, copies: int, gen: torch.Generator):
    """Posterior mean/std of ``copies`` augmented versions of every image (copy 0 unaugmented)."""
    means, stds = [], []
    for c in range(copies):
        x = images if c == 0 else data.augment(images, gen)
        for chunk in x.split(256):
            post = vae.encode(chunk).latent_dist
            means.append(post.mean)
            stds.append(post.std)
    return torch.cat(means), torch.cat(stds)


def train_unet(unet, text_encoder, tok, means, stds, labels, scale: float, steps: int, gen: torch.Generator,
               rng: random.Random, batch: int = 128, lr: float = 1e-3, ema_decay: float = 0.999,
               p_empty: float = 0.12, snr_gamma: float = 5.0) -> tuple[dict, object, object]:
    from diffusers import DDPMScheduler

    sched = DDPMScheduler.from_config(SCHEDULER_CONFIG)
    abar = sched.alphas_cumprod.float()
    snr = abar / (1 - abar)
    weight = torch.clamp(snr, max=snr_gamma) / snr  # min-SNR weighting for epsilon prediction
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    ema_unet, ema_te = copy.deepcopy(unet).eval(), copy.deepcopy(text_encoder).eval()
    ema_params = list(ema_unet.parameters()) + list(ema_te.parameters())
    # Pre-tokenize every phrasing once; batches then just index into the table.
    cache: dict[str, torch.Tensor] = {}

    def ids_for(prompts):
        for p in prompts:
            if p not in cache:
                cache[p] = tok(p, padding="max_length", max_length=tok.model_max_length, truncation=True,
                               return_tensors="pt").input_ids[0]
        return torch.stack([cache[p] for p in prompts])

    unet.train()
    text_encoder.train()
    n_img = len(labels)
    bar = progress(steps, "unet", "step", dynamic_ncols=True)
    avg = None
    for step in range(steps):
        set_lr(opt, lr_at(step, steps, lr, 500))
        idx = torch.randint(0, len(means), (batch,), generator=gen)
        z0 = (means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=gen)) * scale
        ids = ids_for(data.sample_prompts(labels[(idx % n_img).numpy()], rng, p_empty))
        t = torch.randint(0, 1000, (batch,), generator=gen)
        noise = torch.randn(z0.shape, generator=gen)
        zt = abar[t].sqrt().view(-1, 1, 1, 1) * z0 + (1 - abar[t]).sqrt().view(-1, 1, 1, 1) * noise
        ctx = text_encoder(ids)[0]
        pred = unet(zt, t, encoder_hidden_states=ctx).sample
        loss = (weight[t] * (pred - noise).pow(2).mean(dim=(1, 2, 3))).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        d = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, p in zip(ema_params, params):
                pe.lerp_(p, 1 - d)
        avg = loss.item() if avg is None else 0.99 * avg + 0.01 * loss.item()
        bar.set_postfix(loss=f"{avg:.4f}")
        bar.update(1)
    bar.close()
    return {"unet_loss": avg}, ema_unet, ema_te


def write_folder(out: Path, vae, text_encoder, unet, tok) -> None:
    from diffusers import DDIMScheduler

    out.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0",
             "feature_extractor": [None, None], "safety_checker": [None, None], "requires_safety_checker": False,
             "scheduler": ["diffusers", "DDIMScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    vae.save_pretrained(out / "vae", safe_serialization=True)
    unet.save_pretrained(out / "unet", safe_serialization=True)
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)
    data.save_tokenizer(tok, out / "tokenizer")
    DDIMScheduler.from_config(SCHEDULER_CONFIG).save_pretrained(out / "scheduler")


def train(args) -> int:
    """Train and write the embedded model as the `stepserve train-embedded` flags say (commands/train_embedded.py)."""

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.time()
    images, labels = data.load_digit_images(32)
    tok = data.build_tokenizer(16)
    record: dict = {"seed": args.seed, "threads": args.threads, "vae_steps": args.vae_steps,
                    "unet_steps": args.unet_steps, "batch": args.batch, "lr": args.lr, "aug_copies": args.aug_copies,
                    "torch": torch.__version__}

    if args.reuse_vae:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained((args.out / "vae").resolve(), local_files_only=True).eval()
        old = args.out / "stepserve.json"
        prev = json.loads(old.read_text())["train"] if old.exists() else {}
        record.update({k: prev[k] for k in ("vae_steps", "vae_recon_loss", "vae_kl", "vae_wall_s") if k in prev})
    else:
        t0 = time.time()
        vae = build_vae()
        record.update(train_vae(vae, images, args.vae_steps, gen))
        record["vae_wall_s"] = round(time.time() - t0, 1)
        print(f"vae: {record['vae_wall_s']} s, recon {record['vae_recon_loss']:.4f}, kl {record['vae_kl']:.3f}")

    t0 = time.time()
    means, stds = encode_dataset(vae, images, args.aug_copies, gen)
    scale = float(1.0 / means[: len(images)].std())
    vae.register_to_config(scaling_factor=scale)
    te = build_text_encoder(len(tok), tok.model_max_length, tok.bos_token_id, tok.eos_token_id)
    unet = build_unet()
    lab = torch.from_numpy(labels).repeat(args.aug_copies)
    stats, unet, te = train_unet(unet, te, tok, means, stds, lab.numpy(), scale, args.unet_steps, gen, rng,
                                 batch=args.batch, lr=args.lr)
    record.update(stats)
    record["unet_wall_s"] = round(time.time() - t0, 1)
    print(f"unet: {record['unet_wall_s']} s, loss {record['unet_loss']:.4f}")

    write_folder(args.out, vae, te, unet, tok)
    serving = dict(SERVING, height=32, width=32, min_size=32, max_size=32)  # trained at 32x32 only
    if not args.no_eval:
        from .evaluate import measure_agreement

        m = measure_agreement(args.out, serving["default_sampler"], serving["default_steps"],
                              serving["default_guidance_scale"])
        record["classifier_agreement"] = m["agreement"]
        record["min_seed_pixel_diff"] = round(m["min_seed_diff"], 2)
        print(f"classifier agreement {m['agreement']:.3f}  per digit {m['per_digit']}")
    record["wall_s"] = round(time.time() - t_start, 1)  # this invocation only (excludes a reused VAE)
    record["vae_scaling_factor"] = scale
    (args.out / "stepserve.json").write_text(json.dumps(dict(serving, train=record), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0
