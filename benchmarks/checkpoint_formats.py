"""The checkpoint formats benchmarks/checkpoints.py compares, for one model: how each is written and loaded, what
its weights take (the file on disk, and the denoiser's storage once loaded), how many of the denoiser's parameters
it actually quantizes, and the peak resident memory of a fresh process that loads it and serves one batch.

Run as `python checkpoint_formats.py FOLDER FORMAT FILE STEPS BATCH THREADS` it is that fresh process: it prints
one JSON line with its resident memory (VmRSS) after the imports, after loading and after serving, and its peak
(ru_maxrss)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

FORMATS = ("folder", "safetensors", "Q8_0", "Q4_0", "Q6_K", "int8wo", "int8dq")
GGUF_FORMATS = ("Q8_0", "Q4_0", "Q6_K")


def denoiser_part(folder: Path) -> str:
    """'unet' or 'transformer': the folder's denoiser sub-folder."""
    return "unet" if (folder / "unet").is_dir() else "transformer"


def write_files(folder: Path, out: Path, formats) -> dict[str, Path | None]:
    """format -> the file that `--unet FILE` / `--transformer FILE` reads (None: the folder's own weights)."""
    from stepserve.tiny.single_file import write_denoiser_file

    part = denoiser_part(folder)
    files: dict[str, Path | None] = {}
    for fmt in formats:
        if fmt == "safetensors":
            files[fmt] = write_denoiser_file(folder, part, out / f"{part}.safetensors")
        elif fmt in GGUF_FORMATS:
            files[fmt] = write_denoiser_file(folder, part, out / f"{part}-{fmt.lower()}.gguf", fmt)
        else:
            files[fmt] = None
    return files


def weights_for(folder: Path, fmt: str, file: Path | None):
    from stepserve.pipelines.weights import Weights

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if fmt in ("int8wo", "int8dq"):
        return Weights(quantize=fmt)
    if file is None:
        return None
    return Weights(denoiser=str(file), part=denoiser_part(folder))


def load(folder: Path, fmt: str, file: Path | None):
    from stepserve.engine.loading import load_executor

    return load_executor(str(folder), weights=weights_for(folder, fmt, file))


def denoiser(executor):
    networks = executor.pipeline.networks
    return networks.unet if hasattr(networks, "unet") else networks.transformer


def file_bytes(folder: Path, fmt: str, file: Path | None) -> int | None:
    """The weights on disk: the file, or the folder's denoiser sub-folder (None for a type quantized as it
    loads, which has no file of its own)."""
    if file is not None:
        return file.stat().st_size
    if fmt == "folder":
        return sum(f.stat().st_size for f in (folder / denoiser_part(folder)).glob("*.safetensors"))
    return None


def _storage(t) -> int:
    """Bytes a tensor holds: a tensor subclass (torchao's quantized weights) by its inner tensors."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t).__name__ not in ("Parameter", "Tensor"):
        names, _ = t.__tensor_flatten__()
        return sum(_storage(getattr(t, n)) for n in names)
    return t.untyped_storage().nbytes() if t.numel() else 0


def _logical_numel(p) -> tuple[int, bool]:
    """(the parameter's number of weights, whether they are held quantized)."""
    import math

    quant_type = getattr(p, "quant_type", None)  # diffusers' GGUFParameter: uint8 blocks
    if quant_type is not None:
        import gguf

        if quant_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                          gguf.GGMLQuantizationType.BF16):
            return p.numel(), False
        return math.prod(gguf.quants.quant_shape_from_byte_shape(tuple(p.shape), quant_type)), True
    quantized = hasattr(type(p), "__tensor_flatten__") and type(p).__name__ not in ("Parameter", "Tensor")
    return p.numel(), quantized


def denoiser_stats(module) -> dict:
    """The denoiser's parameters, how many of them are held quantized, and the bytes its weights take."""
    total = quantized = nbytes = 0
    for t in [*module.parameters(), *module.buffers()]:
        nbytes += _storage(t)
    for p in module.parameters():
        n, q = _logical_numel(p)
        total += n
        quantized += n if q else 0
    return {"params": total, "quantized_params": quantized, "module_bytes": nbytes}


def peak_rss(folder: Path, fmt: str, file: Path | None, steps: int, batch: int, threads: int) -> dict:
    """Resident memory of a fresh process that loads `fmt` and serves one batch of `batch` requests."""
    argv = [sys.executable, __file__, str(folder), fmt, str(file or "-"), str(steps), str(batch), str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _now_mb() -> float:
    """Resident memory now (VmRSS; the peak cannot show what a load adds when the imports peaked higher)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _child(folder: str, fmt: str, file: str, steps: int, batch: int, threads: int) -> None:
    import importlib

    # The libraries' code first, so that what loading adds is the weights (diffusers imports lazily).
    import diffusers
    import torch
    import transformers

    from stepserve import Engine, SamplingParams

    for cls in ("UNet2DConditionModel", "FluxTransformer2DModel", "AutoencoderKL", "GGUFQuantizationConfig",
                "TorchAoConfig"):
        getattr(diffusers, cls)
    for cls in ("CLIPTextModel", "T5EncoderModel"):
        getattr(transformers, cls)
    for module in {"int8wo": ("torchao",), "int8dq": ("torchao",)}.get(fmt, ("gguf",) if fmt in GGUF_FORMATS else ()):
        importlib.import_module(module)
    torch.set_num_threads(threads)
    imported = _now_mb()
    executor = load(Path(folder), fmt, None if file == "-" else Path(file))
    loaded = _now_mb()
    params = [SamplingParams(prompt=str(i % 10), seed=i, num_inference_steps=steps) for i in range(batch)]
    results = Engine(executor, strategy="continuous", max_batch_size=batch).generate(params)
    errors = [r.error for r in results if not r.ok]
    if errors:
        raise SystemExit(f"{fmt}: {errors[0]}")
    print(json.dumps({"imported_mb": imported, "loaded_mb": loaded, "served_mb": _now_mb(),
                      "peak_mb": _peak_mb()}))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
