"""The pipeline's networks run as TensorRT engines (TensorRT 10 Python API) on a CUDA device, from an engine folder
written by `stepserve export tensorrt` (`<network>.plan` next to the tokenizer and configs, manifest.json of
format "stepserve-tensorrt").

Each engine gets one execution context using optimization profile 0, the only one the export builds. A call sets
every input's shape on the context (`set_input_shape`), which TensorRT accepts only inside the profile's min..max,
so shapes are checked against the profile first and a batch or size outside it is refused with an error naming the
profile; outputs are allocated as torch tensors of the shape the context infers, every tensor's device address is
bound with `set_tensor_address`, and the engine is enqueued with `execute_async_v3` on torch's current CUDA stream,
so it is ordered with the samplers' torch work and torch's stream-ordered allocator keeps the inputs alive.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from torch import Tensor

ENGINE_FILES = {"text_encoder": "text_encoder.plan", "unet": "unet.plan", "vae_decoder": "vae_decoder.plan"}
EXPECTED_INPUTS = {"text_encoder": {"input_ids"}, "unet": {"sample", "timestep", "encoder_hidden_states"},
                   "vae_decoder": {"latent_sample"}}
OPTIONAL_INPUTS = {"text_encoder": {"attention_mask"}}
MANIFEST_FILE = "manifest.json"
TENSORRT_FORMAT = "stepserve-tensorrt"
BUILD_HINT = ("build them with `stepserve export tensorrt --onnx ONNX_DIR --out {dir}` on a machine with TensorRT "
              "and the serving GPU, or run {dir}/build_engines.sh there")


class TensorRTUnavailableError(RuntimeError):
    """Something the TensorRT backend needs is missing: the tensorrt package, a CUDA device, or engine files."""


def _torch_dtype(trt, dtype) -> torch.dtype:
    names = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
             "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool}
    for name, torch_dtype in names.items():
        if getattr(trt.DataType, name, None) == dtype:
            return torch_dtype
    raise TypeError(f"TensorRT data type {dtype} has no torch equivalent here")


class EngineRunner:
    """One deserialized engine with its execution context on profile 0; `run` takes and returns torch tensors."""

    def __init__(self, network: str, engine, trt, device: torch.device) -> None:
        self.network = network
        self.engine = engine
        self.device = device
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) != trt.TensorIOMode.INPUT]
        self.dtypes = {n: _torch_dtype(trt, engine.get_tensor_dtype(n)) for n in names}
        missing = EXPECTED_INPUTS[network] - set(self.inputs)
        unknown = set(self.inputs) - EXPECTED_INPUTS[network] - OPTIONAL_INPUTS.get(network, set())
        if missing or unknown or len(self.outputs) != 1:
            raise ValueError(f"{network}: the engine's inputs {sorted(self.inputs)} and outputs {self.outputs} are "
                             f"not those of a stepserve {network} (inputs {sorted(EXPECTED_INPUTS[network])}, one "
                             f"output); rebuild it with `stepserve export tensorrt`")
        # min/opt/max per input of profile 0: the range TensorRT accepts in set_input_shape
        self.profile = {n: tuple(tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(n, 0))
                        for n in self.inputs}
        self.context = engine.create_execution_context()
        if self.context is None:
            raise RuntimeError(f"{network}: TensorRT could not create an execution context (out of GPU memory?)")

    def check_shapes(self, feeds: dict[str, Tensor]) -> None:
        """Refuse shapes outside the optimization profile with an error naming it (TensorRT would only log)."""
        for name in self.inputs:
            lo, _, hi = self.profile[name]
            shape = tuple(feeds[name].shape)
            if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
                raise ValueError(f"{self.network}: input {name} of shape {list(shape)} is outside the engine's "
                                 f"optimization profile (min {list(lo)}, max {list(hi)}); rebuild the engines with "
                                 f"`stepserve export tensorrt` for a larger --max-batch-size or size range")

    def stream_handle(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def run(self, feeds: dict[str, Tensor]) -> Tensor:
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise ValueError(f"{self.network}: no value for input(s) {', '.join(missing)}")
        self.check_shapes(feeds)
        if self.device.type != "cuda":  # tests drive a stand-in engine on the CPU
            return self._run(feeds)
        with torch.cuda.device(self.device):
            return self._run(feeds)

    def _run(self, feeds: dict[str, Tensor]) -> Tensor:
        bound = {n: feeds[n].to(self.device, self.dtypes[n]).contiguous() for n in self.inputs}
        for name, tensor in bound.items():
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                raise ValueError(f"{self.network}: TensorRT refused shape {list(tensor.shape)} for input {name}")
            self.context.set_tensor_address(name, tensor.data_ptr())
        out_name = self.outputs[0]
        out_shape = tuple(int(d) for d in self.context.get_tensor_shape(out_name))
        if any(d < 0 for d in out_shape):
            raise RuntimeError(f"{self.network}: TensorRT could not infer the shape of {out_name} ({out_shape})")
        out = torch.empty(out_shape, dtype=self.dtypes[out_name], device=self.device)
        self.context.set_tensor_address(out_name, out.data_ptr())
        if not self.context.execute_async_v3(self.stream_handle()):
            raise RuntimeError(f"{self.network}: TensorRT failed to enqueue the engine (see its log)")
        return out if out.dtype == torch.float32 else out.float()


class TensorRTNetworks:
    """The three networks of a pipeline as TensorRT engines; torch tensors in and out on one CUDA device."""

    def __init__(self, text_encoder: EngineRunner, unet: EngineRunner, vae_decoder: EngineRunner) -> None:
        self.runners = {"text_encoder": text_encoder, "unet": unet, "vae_decoder": vae_decoder}
        self.runtime = None  # the trt.Runtime that deserialized the engines (set by load_tensorrt_networks)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        runner = self.runners["text_encoder"]
        feeds = {"input_ids": input_ids}
        if "attention_mask" in runner.inputs:
            feeds["attention_mask"] = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        return runner.run(feeds)

    def denoise(self, sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor) -> Tensor:
        return self.runners["unet"].run({"sample": sample, "timestep": timestep,
                                         "encoder_hidden_states": encoder_hidden_states})

    def decode(self, latents: Tensor) -> Tensor:
        return self.runners["vae_decoder"].run({"latent_sample": latents})


def missing_for_tensorrt(engine_dir: Path, device: str) -> list[str]:
    """Everything missing to load the engines of `engine_dir` on `device`, each with how to get it."""
    missing = []
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("the `tensorrt` Python package (TensorRT 10: pip install tensorrt)")
    if not torch.cuda.is_available():
        missing.append(f"a CUDA device for --device {device} (torch.cuda.is_available() is False)")
    absent = [f for f in ENGINE_FILES.values() if not (engine_dir / f).is_file()]
    if absent:
        missing.append(f"engine files {', '.join(absent)} in {engine_dir} ({BUILD_HINT.format(dir=engine_dir)})")
    return missing


def check_engine_dir(engine_dir: Path) -> None:
    """The folder must be an engine folder of `stepserve export tensorrt` (an ONNX folder gets its own hint)."""
    manifest_file = engine_dir / MANIFEST_FILE
    if not manifest_file.is_file():
        raise TensorRTUnavailableError(f"{engine_dir}: no {MANIFEST_FILE}, so not an engine folder; make one with "
                                       f"`stepserve export tensorrt --onnx ONNX_DIR --out {engine_dir}`")
    try:
        fmt = json.loads(manifest_file.read_text()).get("format")
    except ValueError as e:
        raise TensorRTUnavailableError(f"{manifest_file}: not valid JSON ({e})") from None
    if fmt == "stepserve-onnx":
        raise TensorRTUnavailableError(f"{engine_dir} is an ONNX export, not an engine folder; build engines from "
                                       f"it with `stepserve export tensorrt --onnx {engine_dir} --out ENGINE_DIR`")
    if fmt != TENSORRT_FORMAT:
        raise TensorRTUnavailableError(f"{manifest_file}: format {fmt!r} is not {TENSORRT_FORMAT!r}; make an engine "
                                       f"folder with `stepserve export tensorrt`")


def load_tensorrt_networks(engine_dir: Path, device: str = "cuda") -> TensorRTNetworks:
    """Deserialize the three engines of `engine_dir` onto `device` ('cuda' or 'cuda:N')."""
    engine_dir = Path(engine_dir)
    if not str(device).startswith("cuda"):
        raise ValueError(f"device: {device!r} is not allowed for TensorRT engines; allowed: cuda, cuda:N")
    check_engine_dir(engine_dir)
    missing = missing_for_tensorrt(engine_dir, device)
    if missing:
        raise TensorRTUnavailableError(f"cannot run TensorRT engines from {engine_dir}: missing "
                                       + "; ".join(missing))
    import tensorrt as trt

    torch_device = torch.device(device)
    if torch_device.index is None:
        torch_device = torch.device("cuda", torch.cuda.current_device())
    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    runners = {}
    with torch.cuda.device(torch_device):
        for network, file in ENGINE_FILES.items():
            engine = runtime.deserialize_cuda_engine((engine_dir / file).read_bytes())
            if engine is None:
                raise TensorRTUnavailableError(
                    f"{engine_dir / file}: TensorRT {trt.__version__} could not load it; an engine runs only on the "
                    f"TensorRT version and GPU model that built it ({BUILD_HINT.format(dir=engine_dir)})")
            runners[network] = EngineRunner(network, engine, trt, torch_device)
    networks = TensorRTNetworks(runners["text_encoder"], runners["unet"], runners["vae_decoder"])
    networks.runtime = runtime  # kept alive as long as the engines it deserialized
    return networks
