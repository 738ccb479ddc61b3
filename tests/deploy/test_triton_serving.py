"""Both repositories in the tritonserver that ships with nvidia-pytriton, driven through tritonclient: the images
equal stepserve's own for the same requests (uint8 within 1) with mixed steps and seeds sent concurrently, bad
input gets a clear error, a full queue says "queue full", and nothing hangs. Each server starts once per module.

Also pinned here, since clients depend on it: Triton refuses a decoupled model on plain infer (HTTP and gRPC
alike), so the stepserve layout answers over gRPC streaming (and the HTTP generate endpoint)."""

from __future__ import annotations

import json
import queue
import time
import urllib.request

import numpy as np
import pytest
from extras import require

from stepserve.deploy.triton.repository import RepositoryOptions, write_repository

pytestmark = pytest.mark.timeout(240)
# mixed steps, seeds and samplers, all sent at once
REQUESTS = [
    {"prompt": "a handwritten 3", "seed": 11, "steps": 4, "guidance_scale": 3.0, "sampler": "dpmpp_2m"},
    {"prompt": "a handwritten 7", "seed": 12, "steps": 9, "guidance_scale": 3.0, "sampler": "euler"},
    {"prompt": "a handwritten 0", "seed": 13, "steps": 6, "guidance_scale": 1.0, "sampler": "ddim"},
    {"prompt": "a handwritten 7", "seed": 14, "steps": 12, "guidance_scale": 5.0, "sampler": "dpmpp_2m"},
]
TYPES = {"prompt": ("BYTES", object), "negative_prompt": ("BYTES", object), "sampler": ("BYTES", object),
         "seed": ("INT64", np.int64), "steps": ("INT32", np.int32), "guidance_scale": ("FP32", np.float32),
         "height": ("INT32", np.int32), "width": ("INT32", np.int32)}


@pytest.fixture(scope="module")
def onnx_dir(embedded_onnx):
    require("tritonclient.grpc", "triton")
    require("tritonclient.http", "triton")
    require("pytriton", "triton")
    return embedded_onnx


@pytest.fixture(scope="module")
def expected(onnx_dir):
    """stepserve's images for REQUESTS, one at a time, on the same ONNX export."""
    from stepserve.api import Engine
    from stepserve.engine.loading import load_executor
    from stepserve.request.types import SamplingParams

    engine = Engine(load_executor(str(onnx_dir), backend="onnxruntime", threads=1), strategy="none")
    params = [SamplingParams(prompt=r["prompt"], seed=r["seed"], num_inference_steps=r["steps"],
                             guidance_scale=r["guidance_scale"], sampler=r.get("sampler"),
                             negative_prompt=r.get("negative_prompt", "")) for r in REQUESTS]
    return [np.asarray(r.image) for r in engine.generate(params)]


def serve(onnx_dir, tmp_path_factory, name: str, options: RepositoryOptions):
    from stepserve.deploy.triton.server import TritonServer

    repo = write_repository(onnx_dir, tmp_path_factory.mktemp(name) / "repo", options, quiet=True)
    return TritonServer(repo, quiet=True).start()  # its default bounds a hang only: a busy machine loads for minutes


@pytest.fixture(scope="module")
def classic(onnx_dir, tmp_path_factory):
    # a long batcher delay so the four concurrent requests surely share one Triton batch
    server = serve(onnx_dir, tmp_path_factory, "classic", RepositoryOptions(
        mode="classic", max_batch_size=4, max_queue_delay_ms=400, threads=1))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stepserve_server(onnx_dir, tmp_path_factory):
    server = serve(onnx_dir, tmp_path_factory, "stepserve", RepositoryOptions(mode="stepserve", max_batch_size=4,
                                                                              threads=1))
    yield server
    server.stop()


def inputs(module, request: dict) -> list:
    out = []
    for name, value in request.items():
        datatype, dtype = TYPES[name]
        array = np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype)
        tensor = module.InferInput(name, [1, 1], datatype)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def assert_same_image(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == (1, *want.shape[:2], 3) and got.dtype == np.uint8
    diff = np.abs(got[0].astype(int) - want.reshape(got.shape[1:]).astype(int)).max()
    assert diff <= 1, f"uint8 images differ by {diff}"


def stream_all(server, requests: list[dict], timeout_s: float = 90.0) -> dict:
    """Send every request on one gRPC stream at once; request id -> (image or None, error message or None)."""
    import tritonclient.grpc as grpcclient

    replies: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    try:
        for i, request in enumerate(requests):
            client.async_stream_infer("pipeline", inputs(grpcclient, request), request_id=str(i))
        answers = {}
        while len(answers) < len(requests):
            result, error = replies.get(timeout=timeout_s)
            if error is not None:
                # tritonclient drops the id of an error reply; the model names it: "... [request id: 3]"
                rid = str(error).rsplit("[request id: ", 1)[1].split("]", 1)[0]
                answers[rid] = (None, str(error))
            else:
                answers[result.get_response().id] = (result.as_numpy("image"), None)
        return answers
    finally:
        client.stop_stream()
        client.close()


def test_stepserve_layout_images_equal_stepserve_for_concurrent_mixed_requests(stepserve_server, expected):
    answers = stream_all(stepserve_server, REQUESTS)
    for i, want in enumerate(expected):
        image, error = answers[str(i)]
        assert error is None, error
        assert_same_image(image, want)


def test_stepserve_layout_answers_bad_input_with_what_is_allowed_and_serves_on(stepserve_server, expected):
    bad = dict(REQUESTS[0], sampler="plms")
    answers = stream_all(stepserve_server, [bad, REQUESTS[0]])
    image, error = answers["0"]
    assert image is None and "sampler: 'plms' is not supported; allowed: ddim, euler" in error
    assert_same_image(answers["1"][0], expected[0])


def test_a_decoupled_model_is_refused_on_plain_infer_and_served_on_http_generate(stepserve_server, expected):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="decoupled"):
        httpclient.InferenceServerClient(stepserve_server.http_url).infer("pipeline", inputs(httpclient, REQUESTS[0]))
    with pytest.raises(InferenceServerException, match="decoupled"):
        grpcclient.InferenceServerClient(stepserve_server.grpc_url).infer("pipeline", inputs(grpcclient, REQUESTS[0]))
    body = json.dumps(REQUESTS[0]).encode()
    request = urllib.request.Request(f"http://{stepserve_server.http_url}/v2/models/pipeline/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        flat = np.array(json.loads(response.read())["image"], dtype=np.uint8)  # generate flattens the tensor
    assert np.abs(flat.astype(int) - expected[0].reshape(-1).astype(int)).max() <= 1


def test_a_full_engine_queue_is_answered_with_queue_full(onnx_dir, tmp_path_factory):
    server = serve(onnx_dir, tmp_path_factory, "bounded", RepositoryOptions(
        mode="stepserve", max_batch_size=1, max_queue=1, threads=1))
    try:
        answers = stream_all(server, [dict(REQUESTS[1], steps=40, seed=s) for s in range(5)])
    finally:
        server.stop()
    errors = [e for _, e in answers.values() if e is not None]
    served = [im for im, _ in answers.values() if im is not None]
    assert errors and served, answers
    assert all("queue full: queue is full (1 waiting)" in e for e in errors), errors


def test_classic_layout_batches_concurrent_requests_and_images_equal_stepserve(classic, expected):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(classic.http_url, concurrency=len(REQUESTS), network_timeout=120)
    pending = [client.async_infer("pipeline", inputs(httpclient, r)) for r in REQUESTS]
    for handle, want in zip(pending, expected):
        assert_same_image(handle.get_result(timeout=120).as_numpy("image"), want)
    # Triton records a model's statistics after its execute returns, which can be after the client has the
    # answers (seen on a slow machine: a count of 0 right after all four came back): wait for them to land
    stats = client.get_inference_statistics("pipeline")["model_stats"][0]
    for _ in range(60):
        if stats["inference_count"] >= len(REQUESTS):
            break
        time.sleep(0.5)
        stats = client.get_inference_statistics("pipeline")["model_stats"][0]
    assert stats["inference_count"] == len(REQUESTS)
    assert stats["execution_count"] < len(REQUESTS), "Triton's dynamic batcher should have batched the requests"
    client.close()


def test_classic_layout_answers_bad_input_over_grpc_with_what_is_allowed(classic):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(classic.grpc_url)
    with pytest.raises(InferenceServerException, match=r"steps: must be an integer in \[1, 200\], got 0"):
        client.infer("pipeline", inputs(grpcclient, dict(REQUESTS[0], steps=0)), client_timeout=60)
    client.close()
