"""Model argument -> executor: the one place that turns what a caller names into an executor.

A model argument is 'embedded' (the model that ships with stepserve), a local diffusers folder (model_index.json;
its `_class_name` picks the family adapter, pipelines/registry.py) or an export folder (manifest.json, written by
`stepserve export onnx` or `stepserve export tensorrt`); 'fake' is the simulated accelerator (executor/fake.py, which
build_engine makes instead of loading anything). The backend says how the three networks run
(stepserve/backends): torch runs the folder's modules; onnxruntime runs an ONNX export; tensorrt runs engine plans.
The samplers run in torch on every backend.

Exporting is not loading: this module never exports. A command that is given a diffusers folder with
`--backend onnxruntime` resolves it to its cached export first (stepserve/deploy/onnx_cache.py).
"""

from __future__ import annotations

import os
from pathlib import Path

BACKENDS = ("torch", "onnxruntime", "tensorrt")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
EXPORT_MANIFEST = "manifest.json"  # marks an export folder (ONNX graphs or TensorRT plans)


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (taskset, a container's cpuset), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API on this platform
        return os.cpu_count() or 1


def default_threads() -> int:
    """Torch's intra-op threads by default: all cores but one, at least 1. The spare core runs what feeds the
    engine (the server's event loop and HTTP work, or the bench's load generator); with a thread on every core,
    torch's OpenMP threads spin-wait for a core that other work holds, and steps under load get much slower."""
    return max(1, available_cores() - 1)


def is_export_dir(path: str | os.PathLike) -> bool:
    return str(path) != "embedded" and (Path(path).expanduser() / EXPORT_MANIFEST).is_file()


def check_model_argument(model: str | os.PathLike) -> None:
    """Fail fast, before any heavy import, when `model` names nothing that can be loaded."""
    folder = Path(model).expanduser()
    from ..executor.fake import FAKE

    if str(model) not in ("embedded", FAKE) and not any((folder / f).is_file() for f in ("model_index.json", EXPORT_MANIFEST)):
        raise FileNotFoundError(f"model: {str(model)!r} is neither 'embedded' nor a local diffusers folder with "
                                f"model_index.json (nor an export folder with {EXPORT_MANIFEST}, nor 'fake')")


def check_weights(weights, device: str, backend: str) -> None:
    """ValueError (a MissingExtraError for a library not installed) when `weights` (pipelines.weights.Weights)
    cannot load here: another backend, a --quantize type or --offload the device cannot run. Cheap, and run
    before anything loads (`stepserve serve` runs it before the model's first line too)."""
    if weights is None or not weights.changed:
        return
    if backend != "torch":
        flag = f"{weights.flag} FILE" if weights.denoiser else "--quantize"
        raise ValueError(f"{flag} loads on the torch backend only; got --backend {backend}")
    from ..pipelines.offload import check_offload
    from ..pipelines.weights import check_quantize

    check_quantize(weights, device)
    check_offload(weights.offload, device)


def check_runtime(device: str, dtype: str, backend: str) -> None:
    """ValueError naming what is allowed, for a device, dtype or backend that cannot be served."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not supported; allowed: {', '.join(BACKENDS)}")
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ValueError(f"device: {device!r} is not supported; allowed: {', '.join(DEVICES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    if backend == "onnxruntime" and (device != "cpu" or dtype != "float32"):
        raise ValueError(f"backend 'onnxruntime' runs on the CPU in float32; got --device {device} "
                         f"--dtype {dtype} (use --backend torch or tensorrt for a GPU)")
    if backend == "tensorrt" and not str(device).startswith("cuda"):
        raise ValueError(f"backend 'tensorrt' needs --device cuda; got --device {device}")


# How a start-up feature (capabilities.PAIRS_REFUSED) is named to the person who asked for it
STARTUP_FLAGS = {"quantize": "--quantize", "gguf": "a GGUF --unet/--transformer file", "offload_group":
                 "--offload group", "offload_model": "--offload model", "ip_adapter": "--ip-adapter-dir",
                 "controlnets": "--controlnet-dir", "lora": "--lora-dir", "compile": "--compile",
                 "deterministic": "--deterministic", "cache": "--cache"}


def startup_features(config) -> set[str]:
    """The features an EngineConfig asks for at start-up, named as STARTUP_FLAGS names them."""
    weights, fast = config.weights, config.fast_path
    denoiser = getattr(weights, "denoiser", None) or ""
    offload = getattr(weights, "offload", None)
    on = {"quantize": getattr(weights, "quantize", None) is not None, "gguf": denoiser.lower().endswith(".gguf"),
          "offload_group": offload == "group", "offload_model": offload == "model",
          "ip_adapter": config.ip_adapter_dir is not None, "controlnets": config.controlnet_dir is not None,
          "lora": config.lora_dir is not None, "compile": bool(getattr(fast, "compile", False)),
          "deterministic": bool(getattr(fast, "deterministic", False)),
          "cache": config.cache is not None and str(config.cache).lower() not in ("off", "none")}
    return {name for name, asked in on.items() if asked}


def refused_pair(on: set[str]) -> str | None:
    """The one-line refusal of the first pair among the start-up features `on` (STARTUP_FLAGS' names) that no
    family serves together (capabilities.PAIRS_REFUSED, listed in docs/MODELS.md); None: none is."""
    from ..capabilities import PAIRS_REFUSED

    for pair, why in PAIRS_REFUSED.items():
        if pair <= on:
            first, second = sorted(STARTUP_FLAGS[name] for name in pair)
            return f"{first} with {second} is not served ({why}); allowed: one of them"
    return None


def check_pairs(config, gpus: int | None = None) -> None:
    """Before anything loads: a ValueError naming both flags of a pair no family serves together, and why; and
    one for parallel degrees that cannot run here or beside a start-up feature (stepserve/parallel). `gpus`: the
    CUDA devices the engine will see (None: this machine's; Ray replicas on another machine reserve their own)."""
    on = startup_features(config)
    refused = refused_pair(on)
    if refused:
        raise ValueError(refused)
    degrees = getattr(config, "degrees", None)
    if degrees is None or not degrees.enabled:
        return
    from ..parallel.degrees import check_degrees

    if gpus is None:
        gpus = 0
        if str(config.device).startswith("cuda"):
            import torch

            gpus = torch.cuda.device_count()
    check_degrees(degrees, config.device, config.backend, available_cores(), gpus)
    if str(config.device).startswith("cuda:") and str(config.device) != "cuda:0":
        raise ValueError(f"{degrees.describe()} with --device {config.device}: the ranks take CUDA devices 0 to "
                         f"{degrees.world - 1}; allowed: --device cuda (choose the devices with CUDA_VISIBLE_DEVICES)")
    refused = {**PARALLEL_REFUSED, **(TENSOR_PARALLEL_REFUSED if degrees.tensor > 1 else {})}
    for name, why in refused.items():
        if name in on and not (name == "deterministic" and degrees.sequence * degrees.tensor == 1):
            raise ValueError(f"{degrees.describe()} with {STARTUP_FLAGS[name]} is not served ({why}); allowed: one "
                             f"of them")


# start-up features a parallel model does not run with, and why
PARALLEL_REFUSED = {
    "compile": "the compiled batch buckets wrap the denoiser that diffusers' parallel hooks split",
    # with --cfg-parallel alone it is served: each CFG half runs its rows at the fixed padded shape on its own
    # rank (tests/parallel/test_cfg_deterministic.py); diffusers' token and weight splits are not checked so
    "deterministic": "byte-identical images across batch mixes are held for --cfg-parallel alone; the sequence "
                     "and tensor splits' collectives are not checked at the fixed padded shape",
    "offload_model": "offloading moves the networks that every rank holds whole on its own device",
    "offload_group": "offloading moves the networks that every rank holds whole on its own device",
}

# ... and with --tensor-parallel-size (its weights are DTensor shards): not checked on a GPU yet, so not served
TENSOR_PARALLEL_REFUSED = {
    "lora": "a LoRA adapter's full-width factors do not meet the sharded Linear layers",
    "quantize": "quantized weights are not sharded by diffusers' tensor-parallel plan",
    "gguf": "quantized weights are not sharded by diffusers' tensor-parallel plan",
}


def load_executor(model: str | os.PathLike = "embedded", device: str = "cpu", dtype: str = "float32",
                  backend: str = "torch", threads: int | None = None, weights=None):
    """A TorchExecutor over `model`'s family adapter on `backend`. `threads`: onnxruntime's intra-op threads
    (torch's are set by the engine builder); `weights` (pipelines.weights.Weights): a file that replaces the
    folder's denoiser (torch backend). Raises FileNotFoundError or ValueError with a message that names the
    argument and what is allowed."""
    check_runtime(device, dtype, backend)
    check_model_argument(model)
    check_weights(weights, device, backend)
    import torch

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available; use --device cpu")
    from ..executor.torch_executor import TorchExecutor

    return TorchExecutor(_load_adapter(model, backend, device, getattr(torch, dtype), threads, weights))


def _load_adapter(model, backend: str, device: str, dtype, threads: int | None, weights=None):
    from ..pipelines.diffusers_sd import StableDiffusionAdapter
    from ..pipelines.registry import load_family_adapter, require_export_family

    if backend == "torch":  # the folder's model_index.json _class_name picks the family adapter
        return load_family_adapter(model, device=device, dtype=dtype, weights=weights)
    if not is_export_dir(model):
        require_export_family(model, backend)  # another family: say so by name first
        kind = "stepserve export onnx" if backend == "onnxruntime" else "stepserve export tensorrt"
        raise ValueError(f"backend {backend!r} runs an export folder (with {EXPORT_MANIFEST}); {str(model)!r} is "
                         f"not one: make one with `{kind}`, or let `stepserve serve/bench/profile --backend "
                         f"onnxruntime` export the model once into its cache (stepserve.deploy.onnx_cache.onnx_folder)")
    if backend == "onnxruntime":
        return StableDiffusionAdapter.from_onnx_dir(Path(model), threads=threads)
    from ..backends.tensorrt import load_tensorrt_networks

    networks = load_tensorrt_networks(Path(model), device)
    return StableDiffusionAdapter.from_export_dir(model, networks, "tensorrt", device)
