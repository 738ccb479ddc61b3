"""The flags that several commands share, defined once, and argparse value types that say what is allowed.

- `add_model_flags`: --model, --device, --dtype, --backend, --threads (serve, profile, bench);
- `add_fast_path_flags`: --compile, --compile-buckets, --deterministic (serve, profile, bench);
- `engine_config`: those flags (and a command's own EngineOptions) -> the EngineConfig that
  stepserve.engine.config.build_engine builds, with the ONNX export cache resolved for --backend onnxruntime.

Each value type refuses a bad value with a message that says what is allowed (argparse turns it into
`error: argument --flag: expected ..., got '...'`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from ..addons.budgets import AUTO, default_help
from ..engine.loading import BACKENDS, DEVICES, DTYPES, default_threads
from ..pipelines.offload import OFFLOAD_MODES
from ..pipelines.weights import QUANTIZE_TYPES


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with every flag's default (unless it has none, or its help already says it); descriptions and
    epilogs as written. Every command's parser uses it (tests/test_cli_help.py checks each flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == [] or default == argparse.SUPPRESS
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)".strip()


class OneLineParser(argparse.ArgumentParser):
    """Errors in one line (`PROG: error: ...`, exit status 2), not the whole usage block; defaults shown in
    --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_from(low: int, high: int | None = None):
    """An integer >= `low` (and <= `high` when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            allowed = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        return value

    return parse


def float_from(low: float, inclusive: bool, what: str):
    """A finite float above `low` (or at least `low` when inclusive); `what` says what is allowed."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        ok = value >= low if inclusive else value > low
        if not ok or math.isinf(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def bucket_list(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> batch sizes, each >= 1, in increasing order."""
    try:
        sizes = sorted({int(v) for v in text.split(",")})
    except ValueError:  # not a number, or an empty item
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes >= 1 (e.g. 1,2,4,8,16), got {text!r}")
    return tuple(sizes)


class RepeatedModel(argparse.Action):
    """--model given more than once (serve's several models): every value in `models_given`, in order; `model`
    keeps the first, so that one --model reads as it always has."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.models_given = [*(getattr(namespace, "models_given", None) or []), values]
        if len(namespace.models_given) == 1:
            setattr(namespace, self.dest, values)


def add_model_flags(p: argparse.ArgumentParser, model_help: str | None = None, where: str = "",
                    model_in=None, repeatable: bool = False) -> None:
    """What to load and where it runs. `where` is appended to the help of the runtime flags (e.g. ' (in-process
    only)'); `model_in`: the group --model goes in (a mutually exclusive one), default the parser. `repeatable`:
    --model may be given more than once (a list, None when not given: serve's several models)."""
    (model_in or p).add_argument("--model", default="embedded", action=RepeatedModel if repeatable else "store",
                                 help=model_help or "'embedded' or a local diffusers folder (model_index.json)")
    if repeatable:
        p.set_defaults(models_given=[])
    p.add_argument("--config", metavar="DIR", default=None,
                   help="with --model FILE.safetensors (a whole SD 1/2 or SDXL checkpoint): a diffusers folder of the "
                        "same model that gives its configs, tokenizers and scheduler (its weights are not read)"
                        + where)
    p.add_argument("--transformer", metavar="FILE", default=None,
                   help="the denoiser's weights from one file instead of --model's transformer folder: a "
                        ".safetensors (original or diffusers keys) or a .gguf (quantized; stepserve[quant]); "
                        "--model gives the architecture (docs/MODELS.md)" + where)
    p.add_argument("--unet", metavar="FILE", default=None,
                   help="as --transformer, for models whose denoiser is a UNet (SD 1/2, SDXL)" + where)
    p.add_argument("--quantize", default=None, choices=QUANTIZE_TYPES, metavar="TYPE",
                   help="quantize the denoiser as it loads: int8wo, int8dq (CPU or GPU), int4wo, float8wo, nf4 "
                        "(GPU); torchao's or bitsandbytes' (stepserve[quant], stepserve[bnb])" + where)
    p.add_argument("--quantize-text", action="store_true",
                   help="with --quantize (a torchao type): quantize the text encoders too" + where)
    p.add_argument("--offload", default=None, choices=OFFLOAD_MODES, metavar="MODE",
                   help="for models larger than the device: hold the networks in CPU memory and move them to it as "
                        "they run; model (each network whole, one at a time) or group (the denoiser block by "
                        "block); needs --device cuda" + where)
    p.add_argument("--device", default="cpu", choices=DEVICES, help="where the networks run" + where)
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the networks' precision" + where)
    p.add_argument("--backend", default="torch", choices=BACKENDS,
                   help="how the networks run (the samplers are torch on all): torch; onnxruntime (CPU, float32; "
                        "--model may be an ONNX export, else the model is exported once into a cache); tensorrt "
                        "(--model is a folder from `stepserve export tensorrt`, needs --device cuda)" + where)
    p.add_argument("--threads", type=int_from(1), default=default_threads(),
                   help="torch intra-op CPU threads (onnxruntime's too). The default is the cores this process "
                        "may use minus one, at least 1: the spare core runs what feeds the engine (HTTP, or the "
                        "load generator), so torch's threads do not spin-wait on it" + where)


def add_fast_path_flags(p: argparse.ArgumentParser) -> None:
    """--compile, --compile-buckets and --deterministic (stepserve.backends.fast_path)."""
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the denoiser for a fixed set of batch sizes (a step pads its rows to the "
                        "next one; CUDA graphs per batch size on a GPU), all built at start-up (torch backend)")
    p.add_argument("--compile-buckets", type=bucket_list, default=None, metavar="N,N,...",
                   help="the batch buckets (denoiser rows) to compile for (default: powers of two up to twice "
                        "--max-batch-size, a conditional and an unconditional row per request)")
    p.add_argument("--deterministic", action="store_true",
                   help="byte-identical images whoever shares the batch: every forward runs at one fixed "
                        "padded shape (slower at low load; torch backend)")


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """--ulysses-degree, --ring-degree, --cfg-parallel, --tensor-parallel-size (stepserve/parallel)."""
    g = p.add_argument_group("one request over several devices (docs/SCALING.md)")
    g.add_argument("--ulysses-degree", type=int_from(1), default=1, metavar="N",
                   help="split each forward's tokens over N ranks with Ulysses attention (diffusers' context-"
                        "parallel hooks; Flux.1, Flux.2, Qwen-Image, Wan; CPU ranks run over gloo)")
    g.add_argument("--ring-degree", type=int_from(1), default=1, metavar="N",
                   help="split the tokens over N ranks with ring attention (needs flash or cuDNN attention: CUDA)")
    g.add_argument("--cfg-parallel", action="store_true",
                   help="run the conditional and unconditional rows on two halves of the ranks (models with true "
                        "classifier-free guidance: SD 1/2, SDXL, SD3, Qwen-Image, Wan)")
    g.add_argument("--tensor-parallel-size", type=int_from(1), default=1, metavar="N",
                   help="shard the transformer's weights over N CUDA devices (diffusers' tensor-parallel plans: "
                        "Flux.1, Flux.2, Qwen-Image)")


def degrees_from_args(args: argparse.Namespace):
    """The parallel.degrees.Degrees the flags ask for (one device when a command has none of them)."""
    from ..parallel.degrees import Degrees

    return Degrees(ulysses=getattr(args, "ulysses_degree", 1), ring=getattr(args, "ring_degree", 1),
                   cfg=bool(getattr(args, "cfg_parallel", False)), tensor=getattr(args, "tensor_parallel_size", 1))


def cache_value(text: str):
    """--cache: a policy name, 'off', or a JSON object such as '{"policy": "fbcache", "threshold": 0.1}'."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("expected a JSON object")
        return value
    return text


def add_cache_flag(p: argparse.ArgumentParser) -> None:
    """--cache: step caching for requests that do not say (stepserve/caching, docs/CACHING.md)."""
    p.add_argument("--cache", type=cache_value, default=None, metavar="POLICY|JSON",
                   help="step caching for requests without a 'cache' field: fbcache, deepcache (UNets), magcache "
                        "(Flux), or a JSON object with knobs, e.g. '{\"policy\": \"fbcache\", \"threshold\": "
                        "0.1}' (torch backend, not with --compile/--deterministic; default: off)")


def add_lora_flag(p: argparse.ArgumentParser) -> None:
    """--lora-dir: the folder LoRA adapters are served from (stepserve/lora, docs/LORA.md)."""
    p.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="serve LoRA adapters from this folder: every *.safetensors in it and its subfolders by its "
                        "relative path without extension ('/' read as '.'), a save_lora_weights folder by its "
                        "path, loaded at start-up while --lora-memory-mb holds them and the others on first "
                        "use; POST /v1/loras loads more from it (torch backend; default: no adapters)")
    p.add_argument("--lora-memory-mb", type=float_from(0.0, False, "a number of megabytes > 0"), default=None, metavar="MB",
                   help="device memory for loaded LoRA adapters (their weights and their per-layer stacks); to "
                        "load another, the least recently used one that no request in the engine carries is "
                        f"unloaded (it loads again on its next use); {default_help('lora')}")


def add_controlnet_flag(p: argparse.ArgumentParser) -> None:
    """--controlnet-dir: the folder ControlNets are served from (stepserve/controls, docs/CONTROLNET.md)."""
    p.add_argument("--controlnet-dir", default=None, metavar="DIR",
                   help="serve ControlNets from this folder: every sub-folder holding a diffusers ControlNet "
                        "(config.json and its weights) by the sub-folder's name, loaded on first use (SD 1/2, "
                        "SDXL, SD3, Flux.1 and Qwen-Image models, torch backend; default: no ControlNets)")
    p.add_argument("--controlnet-memory-mb", type=float_from(0.0, False, "a number of megabytes > 0"), default=None,
                   metavar="MB", help="device memory for loaded ControlNets; to load another, the least recently "
                                      "used ones no request in flight uses are unloaded (they load again on next "
                                      f"use); {default_help('controlnet')}")
    p.add_argument("--ip-adapter-dir", default=None, metavar="DIR",
                   help="serve IP-Adapters (an image as a prompt) from this folder: every sub-folder holding an "
                        "adapter's weights and its image_encoder/ by the sub-folder's name, loaded on first use "
                        "(SD 1/2 and SDXL models, torch backend; default: none)")
    p.add_argument("--ip-adapter-memory-mb", type=float_from(0.0, False, "a number of megabytes > 0"),
                   default=None, metavar="MB",
                   help="device memory for loaded IP-Adapters, each with its image encoder; to load another, the "
                        "least recently used ones no request in flight uses are unloaded; "
                        + default_help("ip_adapter"))


def check_cache_and_lora_flags(args: argparse.Namespace) -> None:
    """--cache and --lora-dir checked before the model loads, as far as they can be without it (the model's own
    policies are checked once it is loaded). Raises StartupError naming the flag."""
    from ..engine.loading import refused_pair
    from ..server.startup import StartupError

    controlnet_dir, ip_adapter_dir = getattr(args, "controlnet_dir", None), getattr(args, "ip_adapter_dir", None)
    torch_only = [flag for flag, value in (("--cache", args.cache), ("--lora-dir", args.lora_dir),
                                           ("--controlnet-dir", controlnet_dir),
                                           ("--ip-adapter-dir", ip_adapter_dir)) if value]
    if torch_only and args.backend != "torch":
        raise StartupError(f"{' and '.join(torch_only)} need --backend torch (got {args.backend})")
    refused = refused_pair({name for name, value in (
        ("cache", args.cache and str(args.cache).lower() not in ("off", "none")), ("lora", args.lora_dir),
        ("controlnets", controlnet_dir), ("ip_adapter", ip_adapter_dir), ("compile", args.compile),
        ("deterministic", args.deterministic)) if value})
    if refused:  # the rest of the pairs (weights, offload) are the engine's to refuse: they need the model's flags
        raise StartupError(refused)
    for flag, folder in (("--lora-dir", args.lora_dir), ("--controlnet-dir", controlnet_dir),
                         ("--ip-adapter-dir", ip_adapter_dir)):
        if folder and not Path(folder).is_dir():
            raise StartupError(f"{flag}: {folder!r} is not a folder")
    if args.cache and str(args.cache).lower() not in ("off", "none"):
        from ..caching.spec import POLICIES, CacheSpecError, parse_cache
        from ..request.types import ModelInfo

        anything = ModelInfo(name="any model", default_sampler="euler", default_steps=1, default_guidance_scale=1.0,
                             default_height=8, default_width=8, size_multiple=8, min_size=8, max_size=8,
                             cache_policies=tuple(POLICIES))
        try:
            parse_cache(args.cache, anything)
        except CacheSpecError as exc:
            raise StartupError(f"--cache: {exc}") from None


def fast_path_from_args(args: argparse.Namespace):
    from ..backends.fast_path import FastPathOptions

    return FastPathOptions(compile=args.compile, deterministic=args.deterministic, batch_buckets=args.compile_buckets)


def is_checkpoint_file(model: str) -> bool:
    """Whether --model names a whole-model file rather than a folder."""
    return str(model).lower().endswith((".safetensors", ".ckpt", ".gguf"))


def check_checkpoint_flags(args: argparse.Namespace) -> None:
    """ValueError unless --model FILE (a whole-model file) and --config DIR come together: checked before the model
    folder is, so that a lone file is told about --config rather than that it is no folder."""
    checkpoint, config = is_checkpoint_file(args.model), getattr(args, "config", None)
    if checkpoint and not config:
        raise ValueError(f"--model {args.model} is one file: add --config DIR, a diffusers folder of the same model "
                         "(its configs, tokenizers and scheduler; its weights are not read)")
    if config and not checkpoint:
        raise ValueError(f"--config {config} goes with --model FILE.safetensors (a whole-model file); "
                         f"--model {args.model} is a folder already")


def weights_from_args(args: argparse.Namespace):
    """--model FILE (with --config DIR), --transformer FILE / --unet FILE, --quantize and --offload as a
    pipelines.weights.Weights, or None: the folder's own weights."""
    from ..pipelines.weights import Weights

    quantize, text = getattr(args, "quantize", None), getattr(args, "quantize_text", False)
    offload = getattr(args, "offload", None)
    check_checkpoint_flags(args)
    checkpoint = os.path.abspath(args.model) if is_checkpoint_file(args.model) else None  # (Ray workers' cwd)
    if getattr(args, "transformer", None) and getattr(args, "unet", None):
        raise ValueError("--transformer and --unet both replace the denoiser: give one")
    for part in ("transformer", "unet"):
        if getattr(args, part, None):
            return Weights(denoiser=os.path.abspath(getattr(args, part)), part=part, quantize=quantize,
                           checkpoint=checkpoint, quantize_text=text, offload=offload)
    if quantize or checkpoint or text or offload:
        return Weights(quantize=quantize, checkpoint=checkpoint, quantize_text=text, offload=offload)
    return None


def model_of(args: argparse.Namespace) -> str:
    """The diffusers folder to load: --model, or --config when --model is a whole-model file."""
    return args.config if is_checkpoint_file(args.model) and getattr(args, "config", None) else args.model


def engine_config(args: argparse.Namespace, options, memory_cap: bool = True):
    """The EngineConfig of the model flags, the fast path flags and a command's EngineOptions. On --backend
    onnxruntime a diffusers folder becomes its cached ONNX export (exported once, on first use)."""
    from ..deploy.onnx_cache import serving_model
    from ..engine.config import EngineConfig

    weights = weights_from_args(args)
    model = serving_model(model_of(args), args.backend)
    return EngineConfig(model=model, device=args.device, dtype=args.dtype, backend=args.backend,
                        threads=args.threads, weights=weights, memory_cap=memory_cap, fast_path=fast_path_from_args(args),
                        cache=getattr(args, "cache", None), lora_dir=getattr(args, "lora_dir", None),
                        lora_memory_mb=getattr(args, "lora_memory_mb", None) or AUTO,
                        controlnet_dir=getattr(args, "controlnet_dir", None),
                        controlnet_memory_mb=getattr(args, "controlnet_memory_mb", None) or AUTO,
                        ip_adapter_dir=getattr(args, "ip_adapter_dir", None),
                        ip_adapter_memory_mb=getattr(args, "ip_adapter_memory_mb", None) or AUTO,
                        degrees=degrees_from_args(args), options=options)


def say_to_stderr(prog: str):
    """A `say` callback for build_engine: one line on stderr, prefixed with the command's name."""
    return lambda line: print(f"{prog}: {line}", file=sys.stderr, flush=True)
