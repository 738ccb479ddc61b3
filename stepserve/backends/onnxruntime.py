"""The pipeline's networks run by onnxruntime on the CPU, from a `stepserve export onnx` folder.

Sessions are sized for serving next to other work: a fixed number of intra-op threads and no spin-waiting, since
a spinning onnxruntime pool slows every other thread that shares its cores (torch's samplers, the HTTP loop).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

NETWORK_FILES = {"text_encoder": "text_encoder.onnx", "unet": "unet.onnx", "vae_decoder": "vae_decoder.onnx"}


def default_threads() -> int:
    """One core is left for the engine thread and the server loop when there is more than one."""
    cores = os.cpu_count() or 1
    return max(1, cores - 1)


def make_session(path: str | os.PathLike, threads: int | None = None):
    """An onnxruntime CPU session for one network: `threads` intra-op threads (default: cores - 1), one inter-op
    thread, no spinning, full graph optimisation."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or default_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 3  # warnings about unused initializers etc. are noise in a server log
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def _numpy(x: Tensor, dtype: type) -> np.ndarray:
    """A CPU array of `dtype` for onnxruntime; no copy when the tensor already is one (this runs every step)."""
    return x.detach().to("cpu").contiguous().numpy().astype(dtype, copy=False)


class OnnxRuntimeNetworks:
    """Runs text_encoder.onnx, unet.onnx and vae_decoder.onnx; inputs and outputs are CPU torch tensors."""

    def __init__(self, text_encoder, unet, vae_decoder) -> None:
        self.sessions = {"text_encoder": text_encoder, "unet": unet, "vae_decoder": vae_decoder}
        self._text_inputs = {i.name for i in text_encoder.get_inputs()}

    @classmethod
    def from_dir(cls, path: str | os.PathLike, threads: int | None = None) -> "OnnxRuntimeNetworks":
        path = Path(path)
        missing = [f for f in NETWORK_FILES.values() if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: missing {', '.join(missing)}; an ONNX folder is made by "
                                    f"`stepserve export onnx --model M --out DIR`")
        return cls(*(make_session(path / f, threads) for f in NETWORK_FILES.values()))

    def _run(self, name: str, feeds: dict[str, np.ndarray]) -> Tensor:
        return torch.from_numpy(self.sessions[name].run(None, feeds)[0])

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        feeds = {"input_ids": _numpy(input_ids, np.int64)}
        if "attention_mask" in self._text_inputs:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            feeds["attention_mask"] = _numpy(attention_mask, np.int64)
        return self._run("text_encoder", feeds)

    def denoise(self, sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor) -> Tensor:
        return self._run("unet", {"sample": _numpy(sample, np.float32), "timestep": _numpy(timestep, np.float32),
                                  "encoder_hidden_states": _numpy(encoder_hidden_states, np.float32)})

    def decode(self, latents: Tensor) -> Tensor:
        return self._run("vae_decoder", {"latent_sample": _numpy(latents, np.float32)})
