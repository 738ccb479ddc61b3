"""config.pbtxt text for every model of the two repository layouts.

The text is written by hand (no protobuf needed to export); tests parse every variant with Triton's own
ModelConfig schema. The entry model's inputs and outputs are a contract with clients (the bench's triton target):
change them only together with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MODES = ("stepserve", "classic")
NETWORK_BACKENDS = ("python", "onnxruntime")  # how classic's network models run: Python backend or stock ORT
ENTRY_MODEL = "pipeline"
NETWORK_MODELS = ("text_encoder", "unet", "vae_decoder")
_ONNX_TYPES = {"float": "TYPE_FP32", "float16": "TYPE_FP16", "int64": "TYPE_INT64", "int32": "TYPE_INT32"}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the config states it: dims exclude the batch axis; -1 is a free axis. A tensor
    that is only a batch axis (the UNet's timestep) is dims [1] reshaped to []."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None

    def text(self) -> str:
        parts = [f'name: "{self.name}"', f"data_type: {self.data_type}", f"dims: [ {', '.join(map(str, self.dims))} ]"]
        if self.reshape is not None:
            shape = f"[ {', '.join(map(str, self.reshape))} ]" if self.reshape else "[ ]"
            parts.append(f"reshape: {{ shape: {shape} }}")
        if self.optional:
            parts.append("optional: true")
        return "{ " + " ".join(parts) + " }"


# The entry model: one request per batch row, every input one element.
PIPELINE_INPUTS = (
    TensorSpec("prompt", "TYPE_STRING", (1,)),
    TensorSpec("negative_prompt", "TYPE_STRING", (1,), optional=True),
    TensorSpec("seed", "TYPE_INT64", (1,)),
    TensorSpec("steps", "TYPE_INT32", (1,)),
    TensorSpec("guidance_scale", "TYPE_FP32", (1,)),
    TensorSpec("sampler", "TYPE_STRING", (1,), optional=True),
    TensorSpec("height", "TYPE_INT32", (1,), optional=True),
    TensorSpec("width", "TYPE_INT32", (1,), optional=True),
    TensorSpec("timeout_s", "TYPE_FP32", (1,), optional=True),  # a deadline, seconds from arrival
    TensorSpec("cache", "TYPE_STRING", (1,), optional=True),  # step caching: a policy name, "off" or a JSON object
    TensorSpec("loras", "TYPE_STRING", (1,), optional=True),  # LoRA adapters: a JSON list of {"name", "scale"}
)
PIPELINE_OUTPUTS = (TensorSpec("image", "TYPE_UINT8", (-1, -1, -1)),)  # (H, W, C) per request, C = 1 or 3


def network_tensors(described: list[dict]) -> tuple[TensorSpec, ...]:
    """TensorSpecs from an ONNX export's manifest entry ({"name", "dtype", "shape"} with the batch axis first;
    symbolic axes are names)."""
    specs = []
    for t in described:
        if t["dtype"] not in _ONNX_TYPES:
            raise ValueError(f"{t['name']}: ONNX type {t['dtype']!r} has no Triton type here; "
                             f"allowed: {', '.join(_ONNX_TYPES)}")
        dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in t["shape"][1:])
        if dims:
            specs.append(TensorSpec(t["name"], _ONNX_TYPES[t["dtype"]], dims))
        else:
            specs.append(TensorSpec(t["name"], _ONNX_TYPES[t["dtype"]], (1,), reshape=()))
    return tuple(specs)


def _parameters(values: dict[str, str]) -> list[str]:
    return [f"parameters {{ key: {json.dumps(k)} value: {{ string_value: {json.dumps(str(v))} }} }}"
            for k, v in values.items()]


def _io(kind: str, specs: tuple[TensorSpec, ...]) -> list[str]:
    body = ",\n".join(f"  {s.text()}" for s in specs)
    return [f"{kind} [\n{body}\n]"]


def _dynamic_batching(preferred: tuple[int, ...], delay_us: int, max_queue: int | None) -> str:
    """A full batch (max_batch_size) goes at once; a smaller one waits up to the delay for more requests. With
    max_queue, Triton refuses a request beyond it ("Exceeds maximum queue size")."""
    inner = []
    if preferred:
        inner.append(f"preferred_batch_size: [ {', '.join(map(str, preferred))} ]")
    inner.append(f"max_queue_delay_microseconds: {delay_us}")
    if max_queue is not None:
        inner.append(f"default_queue_policy {{ max_queue_size: {max_queue} }}")
    return "dynamic_batching { " + " ".join(inner) + " }"


def pipeline_config(mode: str, max_batch_size: int, max_queue_delay_us: int, max_queue: int | None,
                    parameters: dict[str, str]) -> str:
    """The entry model. stepserve: decoupled, requests handed over one by one at once (stepserve's engine does the
    batching). classic: Triton's dynamic batcher forms the batch a BLS model then runs to completion."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not supported; allowed: {', '.join(MODES)}")
    lines = [f'name: "{ENTRY_MODEL}"', 'backend: "python"', f"max_batch_size: {max_batch_size}"]
    if mode == "stepserve":
        lines.append("model_transaction_policy { decoupled: true }")
    else:
        lines.append(_dynamic_batching((max_batch_size,), max_queue_delay_us, max_queue))
    lines += _io("input", PIPELINE_INPUTS) + _io("output", PIPELINE_OUTPUTS)
    lines.append("instance_group [ { kind: KIND_CPU count: 1 } ]")
    lines += _parameters(parameters)
    return "\n".join(lines) + "\n"


def network_config(name: str, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...], backend: str,
                   max_batch_size: int, max_queue_delay_us: int, parameters: dict[str, str]) -> str:
    """One network of the classic layout, run by the Python backend (onnxruntime inside it: the tritonserver that
    ships with nvidia-pytriton has only that backend) or by Triton's own onnxruntime backend (a stock container)."""
    if backend not in NETWORK_BACKENDS:
        raise ValueError(f"network backend: {backend!r} is not supported; allowed: {', '.join(NETWORK_BACKENDS)}")
    lines = [f'name: "{name}"', f'backend: "{backend}"', f"max_batch_size: {max_batch_size}",
             _dynamic_batching((max_batch_size,), max_queue_delay_us, None)]
    lines += _io("input", inputs) + _io("output", outputs)
    lines.append("instance_group [ { kind: KIND_CPU count: 1 } ]")
    lines += _parameters(parameters)
    return "\n".join(lines) + "\n"
