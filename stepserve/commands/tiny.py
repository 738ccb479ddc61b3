"""`stepserve tiny KIND --out DIR`: write a tiny diffusers folder with random weights (stepserve.tiny), to try a
model family, the server or the bench without downloading anything. It serves noise, quickly.

    stepserve tiny sdxl --out tiny-sdxl && stepserve serve --model tiny-sdxl
    stepserve tiny flux-dev --out tiny-flux --bench-size    # the size the benchmarks use (compute-bound on a CPU)
    stepserve tiny lora --model tiny-sdxl --out loras/ink.safetensors   # a random LoRA adapter for that model
    stepserve tiny controlnet --model tiny-sdxl --out controlnets/edges   # a random ControlNet for that model
    stepserve tiny ip-adapter --model tiny-sdxl --out ip-adapters/face    # a random IP-Adapter (SD 1/2, SDXL)
    stepserve tiny single-file --model tiny-flux --out flux-q8.gguf --quant Q8_0   # its transformer as one file
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path

from ..capabilities import served_for, where_served
from ..tiny.single_file import GGUF_TYPES
from .flags import DefaultsHelpFormatter, OneLineParser

# add-on KIND: (module of stepserve.tiny, its builder, what it is called, serve's flag for the folder above it, the
# models it is written for: those the server runs it for)
ADD_ONS = {
    "controlnet": ("controlnet", "build_tiny_controlnet", "ControlNet", "--controlnet-dir",
                   f"{where_served('controlnets')} (not the embedded model: its UNet has no middle block)"),
    "ip-adapter": ("ipadapter", "build_tiny_ip_adapter", "IP-Adapter", "--ip-adapter-dir",
                   f"{served_for('ip_adapter')} models"),
}

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
    p.add_argument("kind", choices=[*KINDS, "lora", *ADD_ONS, "single-file"],
                   help="model family (and variant) of the folder; 'lora': an adapter for --model; 'controlnet', "
                        "'ip-adapter': one for --model, as a folder of --controlnet-dir / --ip-adapter-dir; "
                        "'single-file': --model's denoiser as one file (.safetensors or .gguf), for "
                        "--transformer FILE / --unet FILE")
    p.add_argument("--out", type=Path, required=True,
                   help="folder to write (created; must not hold a model yet); lora: a .safetensors file, or a "
                        "folder to hold pytorch_lora_weights.safetensors as diffusers' save_lora_weights writes; "
                        "controlnet, ip-adapter: a new folder, served by its name from the folder above it")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--bench-size", action="store_true",
                   help="the larger size the benchmarks use (the module's BENCH_OPTIONS), not the test size")
    lora = p.add_argument_group("lora, controlnet, ip-adapter and single-file")
    lora.add_argument("--model", default="embedded",
                      help="the model folder the adapter is for, or whose denoiser to write ('embedded', or a "
                           "diffusers folder)")
    lora.add_argument("--quant", default=None, choices=GGUF_TYPES,
                      help="single-file to a .gguf: how its weight matrices are quantized")
    lora.add_argument("--whole", action="store_true",
                      help="single-file: the whole SD 1/2 model (UNet, VAE, text encoder) in the original layout, "
                           "for --model FILE --config DIR")
    lora.add_argument("--rank", type=int, default=4, help="the adapter's rank")
    lora.add_argument("--text-encoder", action="store_true", help="adapt the (first) text encoder too")
    return p


def _lora(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ..tiny.lora import build_tiny_lora

    out = args.out if args.out.suffix == ".safetensors" else args.out / "pytorch_lora_weights.safetensors"
    if out.exists():
        p.error(f"--out: {out} exists; give a new file or folder")
    if args.rank < 1:
        p.error(f"--rank: {args.rank}; allowed: a whole number >= 1")
    try:
        with quiet():
            path = build_tiny_lora(args.model, out, seed=args.seed, rank=args.rank, text_encoder=args.text_encoder)
    except ImportError as exc:
        p.error(f"writing an adapter needs peft: install stepserve[lora] ({exc})")
    except (OSError, ValueError) as exc:
        p.error(f"cannot write an adapter for --model {args.model}: {exc}")
    name, lora_dir = (out.stem, out.parent) if out == args.out else (args.out.name, args.out.parent)
    print(f"stepserve tiny: wrote a random rank-{args.rank} LoRA adapter for {args.model} to {path}; serve it as "
          f"{name!r} with `stepserve serve --model {args.model} --lora-dir {lora_dir}`", file=sys.stderr)
    return 0


def _add_on(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """A ControlNet or an IP-Adapter folder for --model, as `tiny lora` writes an adapter: the server serves every
    sub-folder of its --controlnet-dir / --ip-adapter-dir by the sub-folder's name, so --out names it."""
    from ..pipelines.folder import resolve_model_path

    module, builder, what, flag, written_for = ADD_ONS[args.kind]
    if args.out.exists():
        p.error(f"--out: {args.out} exists; give a new folder (it becomes the {what}'s name)")
    try:
        resolve_model_path(args.model)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    build = getattr(importlib.import_module(f"stepserve.tiny.{module}"), builder)
    try:
        with quiet():
            path = build(args.model, args.out, seed=args.seed)
    except Exception as exc:  # noqa: BLE001 - a family the builder does not know fails anywhere inside diffusers
        shutil.rmtree(args.out, ignore_errors=True)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        p.error(f"cannot write the {what} for --model {args.model} ({detail}); it is written for {written_for}")
    print(f"stepserve tiny: wrote a random {what} for {args.model} to {path}; serve it as {args.out.name!r} with "
          f"`stepserve serve --model {args.model} {flag} {args.out.parent}`", file=sys.stderr)
    return 0


def _single_file(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ..pipelines.folder import resolve_model_path
    from ..tiny.single_file import write_denoiser_file

    if args.out.exists():
        p.error(f"--out: {args.out} exists; give a new file")
    if args.out.suffix not in (".safetensors", ".gguf"):
        p.error(f"--out: {args.out} must end in .safetensors or .gguf")
    if (args.out.suffix == ".gguf") != (args.quant is not None):
        p.error("--quant goes with a .gguf --out (and a .gguf needs it): "
                f"allowed: {', '.join(GGUF_TYPES)}")
    if args.whole:
        from ..tiny.ldm_file import write_ldm_file

        if args.quant or args.out.suffix != ".safetensors":
            p.error("--whole writes a .safetensors (no --quant)")
        try:
            path = write_ldm_file(resolve_model_path(args.model), args.out)
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"cannot write --model {args.model} as one file: {exc}")
        print(f"stepserve tiny: wrote {args.model} as one file to {path}; serve it with `stepserve serve --model "
              f"{path} --config {args.model}`", file=sys.stderr)
        return 0
    try:
        folder = resolve_model_path(args.model)
        part = next((d for d in ("transformer", "unet") if (folder / d).is_dir()), None)
        if part is None:
            p.error(f"--model: {folder} has neither a transformer nor a unet folder")
        path = write_denoiser_file(folder, part, args.out, args.quant)
    except ImportError as exc:
        p.error(f"writing a .gguf needs the gguf package: install stepserve[quant] ({exc})")
    except (OSError, ValueError) as exc:
        p.error(f"cannot write the denoiser of --model {args.model}: {exc}")
    print(f"stepserve tiny: wrote {args.model}'s {part} to {path}; serve it with `stepserve serve --model "
          f"{args.model} --{part} {path}`", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.kind == "lora":
        return _lora(p, args)
    if args.kind in ADD_ONS:
        return _add_on(p, args)
    if args.kind == "single-file":
        return _single_file(p, args)
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
