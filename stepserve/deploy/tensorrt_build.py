"""Building TensorRT engines with the TensorRT 10 builder API, where the `tensorrt` package and a CUDA GPU exist.

Each network is parsed from its ONNX file into an explicit-batch network definition (the only mode TensorRT 10 has:
the batch is an ordinary axis of every tensor), given one optimization profile (index 0) whose min/opt/max come
from tensorrt_profiles, a workspace memory-pool limit, and the FP16 builder flag when asked; the serialized engine
is written as `<network>.plan`. trtexec builds the same engine from the command lines in tensorrt_plan.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .tensorrt_plan import EnginePlan
from .tensorrt_profiles import NetworkProfile


class EngineBuildError(RuntimeError):
    """TensorRT could not parse or build a network; the message names the network and TensorRT's reason."""


def missing_requirements() -> list[str]:
    """What this machine lacks to build engines here: the tensorrt package, a CUDA GPU. Empty when it can."""
    missing = []
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("the `tensorrt` Python package (TensorRT 10: pip install tensorrt)")
    import torch

    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    return missing


def tensorrt_version() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return None
    import tensorrt as trt

    return str(trt.__version__)


def build_engine(plan: EnginePlan, profile: NetworkProfile) -> Path:
    """Parse, build and serialize one network's engine into the plan's folder; returns the engine file."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch: TensorRT 10's only (and default) mode
    parser = trt.OnnxParser(network, logger)
    onnx_file = plan.onnx.path / profile.onnx_file
    if not parser.parse_from_file(str(onnx_file)):  # external weight files next to it are found by the parser
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"{profile.network}: TensorRT could not parse {onnx_file}: {errors}")
    graph_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    profiled = {t.name for t in profile.inputs}
    if graph_inputs != profiled:
        raise EngineBuildError(f"{profile.network}: the graph's inputs {sorted(graph_inputs)} are not the inputs "
                               f"of its profile {sorted(profiled)}; re-export the ONNX folder")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_mib * (1 << 20))
    if plan.fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    optimization_profile = builder.create_optimization_profile()
    for t in profile.inputs:
        optimization_profile.set_shape(t.name, t.min, t.opt, t.max)
    config.add_optimization_profile(optimization_profile)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"{profile.network}: TensorRT failed to build the engine (see its log above); "
                               f"try a larger --workspace-mib or build with {plan.out / 'build_engines.sh'}")
    engine_file = plan.out / profile.engine_file
    engine_file.write_bytes(memoryview(serialized))
    return engine_file
