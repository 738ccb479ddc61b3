"""A fake `pipeline` model behind a real tritonserver (the one bundled with nvidia-pytriton), for the Triton target's
tests.

Two variants of the same Python-backend model, each in its own model repository:
- classic: a normal model behind Triton's dynamic batcher;
- decoupled: `model_transaction_policy { decoupled: true }`, answering every request from a thread.

The image of a request is (height, width, 3) uint8 with every pixel equal to fake_pixel(seed, steps); the model
sleeps STEP_MS per step. A prompt starting with "queue full" makes the model refuse the request with that message
(as a server under overload does); steps < 1 is refused as a bad request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stepserve.deploy.triton.server import TritonServer

STEP_MS = 2.0
DEFAULT_SIZE = 8  # height and width when the request leaves them out

_CONFIG = """
name: "%(name)s"
backend: "python"
max_batch_size: %(batch)d
input [
  { name: "prompt", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "negative_prompt", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "seed", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "steps", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "guidance_scale", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "sampler", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "height", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "width", data_type: TYPE_INT32, dims: [ 1 ], optional: true }
]
output [ { name: "image", data_type: TYPE_UINT8, dims: [ -1, -1, 3 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""
_CLASSIC = "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
_BOUNDED = "dynamic_batching { default_queue_policy { max_queue_size: 1 } }\n"  # Triton itself refuses the rest
_DECOUPLED = "model_transaction_policy { decoupled: true }\n"

_MODEL = '''
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

STEP_S = %(step_s)r
DEFAULT_SIZE = %(size)d


def fake_pixel(seed, steps):
    return (seed * 7 + steps * 13) %% 256


def _scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else value.item()


def _answer(request):
    """(steps, response builder): the response is built after the model has slept its steps."""
    prompt = _scalar(request, "prompt")
    steps = int(_scalar(request, "steps"))
    if prompt.startswith("queue full"):
        return 0, lambda: pb_utils.InferenceResponse(error=pb_utils.TritonError(prompt))
    if steps < 1:
        message = f"steps must be >= 1, got {steps}"
        return 0, lambda: pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
    seed = int(_scalar(request, "seed"))
    height = int(_scalar(request, "height", DEFAULT_SIZE))
    width = int(_scalar(request, "width", DEFAULT_SIZE))

    def build():
        image = np.full((1, height, width, 3), fake_pixel(seed, steps), dtype=np.uint8)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("image", image)])

    return steps, build


class TritonPythonModel:
    def initialize(self, args):
        import json

        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.threads = []

    def execute(self, requests):
        if not self.decoupled:  # one batch: sleep for its longest request, answer all
            answers = [_answer(r) for r in requests]
            time.sleep(STEP_S * max(steps for steps, _ in answers))
            return [build() for _, build in answers]
        for request in requests:
            sender = request.get_response_sender()
            steps, build = _answer(request)
            thread = threading.Thread(target=self._reply, args=(sender, steps, build), daemon=True)
            thread.start()
            self.threads.append(thread)
        self.threads = [t for t in self.threads if t.is_alive()]
        return None

    def _reply(self, sender, steps, build):
        time.sleep(STEP_S * steps)
        sender.send(build(), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=5)
'''


def fake_pixel(seed: int, steps: int) -> int:
    """The value of every pixel of the fake model's image for this seed and step count."""
    return (seed * 7 + steps * 13) % 256


def write_repository(root: Path, decoupled: bool) -> Path:
    """A model repository with the fake `pipeline` model, classic or decoupled; the classic one also holds
    `bounded`, the same model with batches of 1 and a queue of 1 (Triton refuses what does not fit)."""
    models = [("pipeline", 8, _DECOUPLED if decoupled else _CLASSIC)] + ([] if decoupled else [("bounded", 1, _BOUNDED)])
    for name, batch, policy in models:
        model = root / name
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(_CONFIG % {"name": name, "batch": batch} + policy)
        (model / "1" / "model.py").write_text(_MODEL % {"step_s": STEP_MS / 1000.0, "size": DEFAULT_SIZE})
    return root


@dataclass
class TritonProcess:
    """A started TritonServer, with URLs in the form the bench's --target takes."""

    server: TritonServer

    @property
    def http_url(self) -> str:
        return f"http://{self.server.http_url}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://{self.server.grpc_url}"

    def stop(self) -> None:
        self.server.stop()


def start_tritonserver(repository: Path, workdir: Path, timeout_s: float = 60.0) -> TritonProcess:
    """The bundled tritonserver (stepserve's own launcher) on free loopback ports, ready to answer."""
    server = TritonServer(repository, log_file=str(workdir / "tritonserver.log"), quiet=True)
    return TritonProcess(server.start(timeout_s))
