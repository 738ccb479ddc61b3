"""The classic layout's entry model: request-level batching, the baseline.

Triton's dynamic batcher hands execute() a batch of requests; they run together to completion through stepserve's
executor and samplers, with the three networks called over BLS (bls_networks.py), and all answers go back when
the batch is done. Nothing joins a running batch: that is what the stepserve layout adds.
"""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from stepserve.api import Engine
from stepserve.executor.torch_executor import TorchExecutor
from stepserve.pipelines.diffusers_sd import StableDiffusionAdapter

from .bls_networks import BlsNetworks
from .requests import BadRequest, parse_request, request_inputs, stack_images
from .settings import limit_torch_threads, model_parameters, optional_int, version_dir


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        limit_torch_threads(optional_int(params.get("torch_threads")))
        export = version_dir(args) / params.get("export_dir", "export")
        manifest = json.loads((export / "manifest.json").read_text())
        text_inputs = frozenset(i["name"] for i in manifest["networks"]["text_encoder"]["inputs"])
        networks = BlsNetworks(int(params["network_max_batch_size"]), text_inputs)
        adapter = StableDiffusionAdapter.from_onnx_dir(export, networks=networks)
        max_batch_size = json.loads(args["model_config"])["max_batch_size"]
        # every request of Triton's batch starts at once and the batch ends when its longest request is done
        self.engine = Engine(TorchExecutor(adapter), strategy="static", max_batch_size=max_batch_size)

    def execute(self, requests):
        responses: list = [None] * len(requests)
        rows: list[tuple[int, int]] = []  # (request index, rows) of the valid requests, in order
        params = []
        for i, request in enumerate(requests):
            inputs = request_inputs(request, pb_utils.get_input_tensor_by_name)
            try:
                parsed = parse_request(inputs, self.engine.model_info)
            except BadRequest as e:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
                continue
            rows.append((i, len(parsed.params)))
            params += parsed.params
        results = self.engine.generate(params) if params else []
        start = 0
        for i, count in rows:
            mine = results[start:start + count]
            start += count
            failed = [r for r in mine if not r.ok]
            try:
                if failed:
                    raise BadRequest(f"generation failed: {failed[0].error or failed[0].status.value}")
                image = stack_images([r.image for r in mine])
                responses[i] = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("image", image)])
            except BadRequest as e:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
        return responses
