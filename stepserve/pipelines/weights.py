"""Where a family's denoiser weights come from when they are not in its diffusers folder: one file.

`Weights(denoiser=FILE, part=...)` replaces the folder's `unet` or `transformer` (`part`, as the flag named it:
`--unet FILE` or `--transformer FILE`) with the file, read by diffusers' `from_single_file`. The architecture is
the folder's own sub-folder config, so the Hub is never touched; the folder's weights for that part are not read.
- `.safetensors`: the original key layout (as community checkpoints and A1111 / ComfyUI keep them) or diffusers'
  own; diffusers converts the first.
- `.gguf`: GGUF-quantized weights (Q8_0, Q5_K, Q4_K, ...) through diffusers' `GGUFQuantizationConfig`, kept
  quantized and computed in the engine's dtype (`--dtype`). Needs the `gguf` package (`stepserve[quant]`).

`Weights(quantize=TYPE)` quantizes the denoiser as it loads (from the folder or the file), through diffusers'
`TorchAoConfig` (torchao: `int8wo`, `int8dq`, `int4wo`, `float8wo`) or `BitsAndBytesConfig` (`nf4`). A type the
device cannot run is refused before anything loads (QUANTIZE_TYPES says where each runs).

`Weights(offload=MODE)` holds the networks in CPU memory and moves them to the device as they run (offload.py).

Every error names the file (or the type) and what was expected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .offload import OFFLOAD_MODES

if TYPE_CHECKING:
    import torch

DENOISER_PARTS = ("unet", "transformer")
FILE_KINDS = (".safetensors", ".gguf")  # as diffusers dispatches on them: by the exact, lower-case suffix


def upper_case_hint(path: Path, kinds: tuple[str, ...]) -> str:
    """For a file whose suffix is one of `kinds` in another case: diffusers reads a file by its exact suffix (it
    would unpickle 'X.SAFETENSORS'), so the file must be renamed."""
    return (f" (diffusers tells kinds apart by the exact suffix: rename it to end in {path.suffix.lower()!r})"
            if path.suffix.lower() in kinds else "")
TEXT_TYPES = ("int8wo", "int8dq", "int4wo", "float8wo")  # --quantize-text: torchao's, through transformers
# whole-model files: the pipelines diffusers reads them for (with the options they take)
WHOLE_FILE_PIPELINES = {"StableDiffusionPipeline": {"safety_checker": None, "requires_safety_checker": False},
                        "StableDiffusionXLPipeline": {}}
# --quantize TYPE: (the library's config, the devices it runs on)
QUANTIZE_TYPES = {"int8wo": ("torchao Int8WeightOnlyConfig", ("cpu", "cuda")),
                  "int8dq": ("torchao Int8DynamicActivationInt8WeightConfig", ("cpu", "cuda")),
                  "int4wo": ("torchao Int4WeightOnlyConfig", ("cuda",)),
                  "float8wo": ("torchao Float8WeightOnlyConfig", ("cuda",)),
                  "nf4": ("bitsandbytes 4-bit NF4", ("cuda",))}


@dataclass(frozen=True)
class Weights:
    """The weights to use instead of the folder's. `denoiser`: a file for the denoiser, or None (the folder's);
    `part`: the folder's sub-folder it replaces ('unet' or 'transformer')."""

    denoiser: str | None = None
    part: str = "transformer"
    quantize: str | None = None  # QUANTIZE_TYPES: the denoiser quantized as it loads
    checkpoint: str | None = None  # a whole-model file (SD 1/2, SDXL) whose parts replace the folder's weights
    quantize_text: bool = False  # the text encoders too (transformers' TorchAoConfig; torchao types only)
    offload: str | None = None  # offload.OFFLOAD_MODES: the networks held in CPU memory, moved to the device to run

    def __post_init__(self) -> None:
        if self.part not in DENOISER_PARTS:
            raise ValueError(f"weights: part {self.part!r} is not a denoiser; allowed: {', '.join(DENOISER_PARTS)}")
        if self.quantize is not None and self.quantize not in QUANTIZE_TYPES:
            raise ValueError(f"--quantize: {self.quantize!r} is not a type; allowed: {', '.join(QUANTIZE_TYPES)}")
        if self.checkpoint is not None and self.denoiser is not None:
            raise ValueError(f"{self.flag} FILE replaces one part; --model {self.checkpoint} is a whole model "
                             "already: give one of them")
        if self.quantize_text and self.quantize not in TEXT_TYPES:
            raise ValueError(f"--quantize-text goes with --quantize {' or '.join(TEXT_TYPES)}; got --quantize "
                             f"{self.quantize}")
        if self.checkpoint is not None and self.quantize is not None:
            raise ValueError(f"--quantize: not available with a whole-model file (--model {self.checkpoint}); "
                             "allowed with a diffusers folder, or a --transformer/--unet .safetensors file")
        if self.offload is not None and self.offload not in OFFLOAD_MODES:
            raise ValueError(f"--offload: {self.offload!r} is not a mode; allowed: {', '.join(OFFLOAD_MODES)}")
        if self.quantize is not None and self.denoiser is not None and self.denoiser.endswith(".gguf"):
            raise ValueError(f"--quantize {self.quantize}: {self.denoiser} is quantized already (GGUF); give one")

    @property
    def changed(self) -> bool:
        """Whether anything differs from the folder's own weights."""
        return (self.denoiser is not None or self.quantize is not None or self.checkpoint is not None
                or self.offload is not None)

    def replaces(self, name: str) -> bool:
        return self.denoiser is not None and name == self.part

    def quantizes(self, name: str) -> bool:
        return self.quantize is not None and (name in DENOISER_PARTS
                                              or (self.quantize_text and name.startswith("text_encoder")))

    @property
    def flag(self) -> str:
        return f"--{self.part}"

    def summary(self) -> str:
        """What start-up lines say of these weights beside the dtype (which stays the compute dtype): "denoiser
        quantized int8wo (torchao Int8WeightOnlyConfig)", the file, the offload mode; "" for the folder's own."""
        said = []
        if self.checkpoint is not None:
            said.append(f"weights from {Path(self.checkpoint).name}")
        if self.denoiser is not None:
            said.append(f"{self.part} from {Path(self.denoiser).name}")
        if self.quantize is not None:
            what = "denoiser and text encoders" if self.quantize_text else "denoiser"
            said.append(f"{what} quantized {self.quantize} ({QUANTIZE_TYPES[self.quantize][0]})")
        if self.offload is not None:
            said.append(f"offload {self.offload}")
        return ", ".join(said)


def check_denoiser_file(weights: Weights, parts: dict[str, Any] | tuple[str, ...]) -> None:
    """Before any weight is read: the file exists, is of a kind diffusers reads, and replaces a part the family
    has (`parts`: the sub-folders the family loads)."""
    if weights.denoiser is None:
        return
    path = Path(weights.denoiser).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{weights.flag}: {weights.denoiser} is not a file")
    if path.suffix not in FILE_KINDS:
        raise ValueError(f"{weights.flag}: {weights.denoiser} is neither a .safetensors nor a .gguf file"
                         + upper_case_hint(path, FILE_KINDS))
    if weights.part not in parts:
        other = next((p for p in DENOISER_PARTS if p in parts), None)
        hint = f"; this model's denoiser is its {other} (use --{other} FILE)" if other else ""
        raise ValueError(f"{weights.flag}: this model has no {weights.part}{hint}")


def check_checkpoint(weights: Weights, pipeline_class: str | None) -> None:
    """Before any weight is read: the whole-model file exists and is a .safetensors, and the folder that gives
    its configs is one diffusers reads whole files for."""
    if weights.checkpoint is None:
        return
    path = Path(weights.checkpoint).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model: {weights.checkpoint} is not a file")
    if path.suffix != ".safetensors":
        raise ValueError(f"model: {weights.checkpoint} is not a .safetensors file (a whole-model checkpoint)"
                         + upper_case_hint(path, (".safetensors",)))
    if pipeline_class not in WHOLE_FILE_PIPELINES:
        raise ValueError(f"model: a whole-model file loads for {', '.join(WHOLE_FILE_PIPELINES)} configs; "
                         f"--config holds a {pipeline_class}")


def load_checkpoint(weights: Weights, config: Path, pipeline_class: str) -> Any:
    """The diffusers pipeline of the whole-model file, its parts configured by the folder `config`."""
    import diffusers

    path = Path(weights.checkpoint).expanduser().resolve()
    try:
        return getattr(diffusers, pipeline_class).from_single_file(
            str(path), config=str(config), local_files_only=True, **WHOLE_FILE_PIPELINES[pipeline_class])
    except Exception as exc:  # noqa: BLE001: diffusers raises KeyError, RuntimeError, ValueError, OSError here
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"model: {path} is not a {pipeline_class} checkpoint of the shapes that {config} "
                         f"describes ({type(exc).__name__}: {reason[:300]})") from exc


def check_quantize(weights: Weights, device: str) -> None:
    """Before anything loads: the type runs on `device`, and its library is installed (else a MissingExtraError,
    a ValueError: one line, no traceback)."""
    if weights.quantize is None:
        return
    what, devices = QUANTIZE_TYPES[weights.quantize]
    kind = str(device).split(":")[0]
    if kind not in devices:
        raise ValueError(f"--quantize {weights.quantize} ({what}) runs on {' or '.join(devices)}, not --device "
                         f"{device}; on {kind}: {', '.join(t for t, (_, d) in QUANTIZE_TYPES.items() if kind in d)}")
    from ..util.extras import MissingExtraError

    module, extra = ("bitsandbytes", "bnb") if weights.quantize == "nf4" else ("torchao", "quant")
    try:
        with quiet_optional_imports():  # torchao warns of every CUDA-only kernel it cannot load on this machine
            __import__(module)
    except ImportError:
        raise MissingExtraError(f"--quantize {weights.quantize} needs {module}: pip install "
                                f"'stepserve[{extra}]'") from None


def quantization_config(weights: Weights, dtype: torch.dtype | None, part_class: type | None = None):
    """The config for --quantize TYPE: diffusers', or transformers' for a transformers model (a text encoder)."""
    import torch

    if part_class is not None and part_class.__module__.startswith("transformers"):
        from torchao import quantization as q
        from transformers import TorchAoConfig as TextConfig

        return TextConfig({"int8wo": q.Int8WeightOnlyConfig, "int8dq": q.Int8DynamicActivationInt8WeightConfig,
                           "int4wo": q.Int4WeightOnlyConfig, "float8wo": q.Float8WeightOnlyConfig}[weights.quantize]())

    if weights.quantize == "nf4":
        from diffusers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_compute_dtype=dtype or torch.float32)
    from diffusers import TorchAoConfig
    from torchao import quantization as q

    make = {"int8wo": q.Int8WeightOnlyConfig, "int8dq": q.Int8DynamicActivationInt8WeightConfig,
            "int4wo": q.Int4WeightOnlyConfig, "float8wo": q.Float8WeightOnlyConfig}[weights.quantize]
    return TorchAoConfig(make())


def load_denoiser(part_class: type, folder: Path, weights: Weights, dtype: torch.dtype | None) -> Any:
    """`part_class` from the single file `weights.denoiser`, configured by `folder` (the pipeline folder's
    sub-folder it replaces)."""
    import torch

    path = Path(weights.denoiser).expanduser().resolve()
    options: dict[str, Any] = {"config": str(folder.parent), "subfolder": folder.name, "local_files_only": True}
    if dtype is not None:
        options["torch_dtype"] = dtype
    if path.suffix == ".gguf":
        options["quantization_config"] = gguf_config(weights, dtype or torch.float32)
    elif weights.quantize is not None:
        options["quantization_config"] = quantization_config(weights, dtype)
    if not hasattr(part_class, "from_single_file"):
        raise ValueError(f"{weights.flag}: diffusers cannot read a {part_class.__name__} from a single file")
    try:
        return part_class.from_single_file(str(path), **options)
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001: diffusers raises KeyError, RuntimeError, ValueError, OSError here
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{weights.flag}: {path} is not a {part_class.__name__} of the shape that {folder} "
                         f"describes ({type(exc).__name__}: {reason[:300]})") from exc


def gguf_config(weights: Weights, compute_dtype: torch.dtype):
    """diffusers' GGUFQuantizationConfig, or an ImportError naming the extra to install."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(f"{weights.flag}: {weights.denoiser} is a GGUF file, which needs the gguf package: "
                          "pip install 'stepserve[quant]'") from None
    from diffusers import GGUFQuantizationConfig

    return GGUFQuantizationConfig(compute_dtype=compute_dtype)


# What optional libraries print as they are first imported, harmless to serving: torchao (stepserve[quant]) warns
# of its CUDA-only kernels on a CPU machine and of enum registrations, and diffusers of torchao tensor types that
# newer torchao versions dropped. Kept to errors while a model loads (when diffusers imports them).
IMPORT_NOISE = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")


@contextlib.contextmanager
def quiet_optional_imports() -> Iterator[None]:
    import logging

    loggers = [logging.getLogger(name) for name in IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
