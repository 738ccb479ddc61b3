"""A classic-layout network model (text_encoder, unet or vae_decoder): its model.onnx run by onnxruntime inside
the Python backend, since the tritonserver that ships with nvidia-pytriton has no onnxruntime backend.

Triton's dynamic batcher hands execute() several requests; their rows are concatenated into one onnxruntime run
(requests whose non-batch shapes differ, e.g. two latent sizes, run as separate groups) and the output is split
back per request.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from stepserve.backends.onnxruntime import make_session


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        threads = int(params["threads"]) if params.get("threads") else None
        self.session = make_session(path, threads)
        self.inputs = [(i.name, len(i.shape)) for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def _arrays(self, request) -> dict[str, np.ndarray]:
        arrays = {}
        for name, rank in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise ValueError(f"input {name!r} is missing; this model takes {', '.join(n for n, _ in self.inputs)}")
            a = tensor.as_numpy()
            arrays[name] = a.reshape(a.shape[0]) if rank == 1 and a.ndim == 2 else a  # timestep: [B, 1] -> [B]
        return arrays

    def execute(self, requests):
        responses: list = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, dict[str, np.ndarray]]]] = {}
        for i, request in enumerate(requests):
            try:
                arrays = self._arrays(request)
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the others
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
                continue
            key = tuple(a.shape[1:] for a in arrays.values())
            groups.setdefault(key, []).append((i, arrays))
        for members in groups.values():
            try:
                feeds = {name: np.concatenate([a[name] for _, a in members]) for name, _ in self.inputs}
                outputs = self.session.run(self.outputs, feeds)
            except Exception as e:  # noqa: BLE001 - the group's requests get the error, the server serves on
                for i, _ in members:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        f"onnxruntime failed: {type(e).__name__}: {e}"))
                continue
            start = 0
            for i, arrays in members:
                rows = len(next(iter(arrays.values())))
                tensors = [pb_utils.Tensor(name, out[start:start + rows]) for name, out in zip(self.outputs, outputs)]
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
                start += rows
        return responses
