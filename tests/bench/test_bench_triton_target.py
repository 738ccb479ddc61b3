"""`--target triton=URL`: the load generator against a real tritonserver (the one nvidia-pytriton bundles) serving a
fake `pipeline` model (triton_fake_repo.py), classic (dynamic batcher) and decoupled (gRPC streaming)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from extras import require
from triton_fake_repo import (
    DEFAULT_SIZE,
    STEP_MS,
    fake_pixel,
    start_tritonserver,
    write_repository,
)

from stepserve.commands.bench import UsageError, config_from_args, main
from stepserve.bench.remote import server_target
from stepserve.bench.targets import FAILED, OK, REJECTED, TIMEOUT
from stepserve.bench.triton_target import (
    FALLBACK_DEFAULTS,
    ModelInputs,
    TritonTarget,
    parse_triton_target,
    request_tensors,
)
from stepserve.bench.workload import RequestSpec


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One tritonserver per variant for the whole module: {"classic": TritonProcess, "decoupled": TritonProcess}."""
    require("tritonclient.grpc", "triton")
    require("tritonclient.http", "triton")
    require("pytriton", "triton")
    started = {}
    try:
        for name, decoupled in (("classic", False), ("decoupled", True)):
            root = tmp_path_factory.mktemp(name)
            started[name] = start_tritonserver(write_repository(root / "models", decoupled), root)
        yield started
    finally:
        for server in started.values():
            server.stop()


def _url(servers, variant: str, protocol: str) -> str:
    server = servers[variant]
    return f"triton={server.grpc_url if protocol == 'grpc' else server.http_url}"


# (variant, protocol, stream mode): every way the target talks to a model
WAYS = [("classic", "grpc", "shared"), ("classic", "http", "shared"), ("decoupled", "grpc", "shared"),
        ("decoupled", "grpc", "per-request")]


def _run(url: str, specs: list[RequestSpec], stream_mode: str = "shared", keep_images: bool = True):
    async def go():
        target = TritonTarget(url, keep_images=keep_images, stream_mode=stream_mode)
        await target.start()
        try:
            return await asyncio.gather(*(target.send(s) for s in specs)), await target.busy_seconds()
        finally:
            await target.stop()

    return asyncio.run(go())


@pytest.mark.parametrize(("variant", "protocol", "stream_mode"), WAYS)
def test_concurrent_requests_all_answer_with_their_own_image(servers, variant, protocol, stream_mode):
    specs = [RequestSpec(f"prompt {i}", seed=i, num_inference_steps=1 + i % 5, guidance_scale=1.5,
                         sampler="euler" if i % 2 else None, height=4 + i % 3, width=6 + i % 2,
                         negative_prompt="blurry" if i % 3 else "") for i in range(40)]
    specs.append(RequestSpec("model defaults", seed=99, num_inference_steps=3))  # no size, no guidance
    replies, busy = _run(_url(servers, variant, protocol), specs, stream_mode)
    assert [r.status for r in replies] == [OK] * len(specs), [r.error for r in replies if r.status != OK]
    for spec, reply in zip(specs, replies):
        assert reply.image.size == (spec.width or DEFAULT_SIZE, spec.height or DEFAULT_SIZE)
        assert reply.image.mode == "RGB"
        assert set(reply.image.getdata()) == {(fake_pixel(spec.seed, spec.num_inference_steps),) * 3}
        assert reply.queue_s is None and reply.denoise_s is None and reply.batch_sizes == []  # Triton does not say
    if variant == "classic":  # the compute time of its batches, from Triton's statistics
        assert busy is not None and busy >= 5 * STEP_MS / 1000
    else:
        assert busy is None


@pytest.mark.parametrize(("variant", "protocol", "stream_mode"), WAYS)
def test_errors_refusals_and_deadlines(servers, variant, protocol, stream_mode):
    specs = [RequestSpec("queue full: 64 requests waiting", seed=1, num_inference_steps=2),
             RequestSpec("a seven", seed=2, num_inference_steps=0),
             # 8 s of work when decoupled (each answered alone), 0.8 s in a classic batch (all wait for it)
             RequestSpec("a slow one", seed=3, num_inference_steps=4000 if variant == "decoupled" else 400,
                         timeout_s=0.15),
             RequestSpec("a quick one", seed=4, num_inference_steps=2, timeout_s=5.0)]
    t0 = time.monotonic()
    (full, bad, slow, quick), _ = _run(_url(servers, variant, protocol), specs, stream_mode, keep_images=False)
    assert full.status == REJECTED and full.reason == "queue_full" and full.error.startswith("queue full")
    assert bad.status == FAILED and "steps must be >= 1, got 0" in bad.error
    assert slow.status == TIMEOUT and slow.reason == "deadline_exceeded"
    assert quick.status == OK and quick.image is None  # images only when asked to keep them
    if variant == "decoupled":  # each answered as soon as it is done: not held up by the late one (8 s)
        assert time.monotonic() - t0 < 4.0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tritons_own_queue_limit_counts_as_rejected(servers, protocol):
    """The dynamic batcher's max_queue_size: Triton refuses with "Exceeds maximum queue size"; the model is named
    by the URL's path."""
    specs = [RequestSpec("a seven", seed=i, num_inference_steps=25) for i in range(8)]  # 50 ms each, one at a time
    replies, _ = _run(f"{_url(servers, 'classic', protocol)}/bounded", specs, keep_images=False)
    rejected = [r for r in replies if r.status == REJECTED]
    assert rejected and all(r.reason == "queue_full" and "maximum queue size" in r.error for r in rejected)
    assert sorted({r.status for r in replies}) == [OK, REJECTED]  # those that fit are answered


def test_a_decoupled_model_over_http_is_refused_with_the_grpc_hint(servers):
    target = TritonTarget(_url(servers, "decoupled", "http"))
    with pytest.raises(ValueError, match=r"is decoupled.*only over gRPC streaming; give its gRPC port"):
        asyncio.run(target.start())


def test_an_unreachable_server_or_unknown_model_is_a_clear_error(servers):
    with pytest.raises(ValueError, match="cannot read the model's config"):
        asyncio.run(TritonTarget(f"{_url(servers, 'classic', 'grpc')}/nomodel").start())


def test_the_bench_cli_drives_triton_end_to_end(servers, tmp_path):
    out = tmp_path / "out"
    decoupled, classic = _url(servers, "decoupled", "grpc"), servers["classic"].grpc_url
    code = main(["--target", decoupled, "--target", f"triton:classic={classic}", "--steps", "2,6", "--rate", "40",
                 "--duration", "1.5", "--warmup", "0.5", "--drain", "2", "--no-progress", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    runs = {r["contender"]: r for r in results["runs"]}
    assert set(runs) == {f"{decoupled}/pipeline", "classic"}  # the default label names the model
    for run in runs.values():
        assert run["counts"]["completed"] > 10 and run["counts"]["failed"] == 0
    assert [i["steps"] for i in results["idle"]] == [2, 6]
    assert results["environment"]["device"] == "triton"  # what the load went to
    report = (out / "report.md").read_text()
    assert "classic" in report and decoupled in report
    assert (out / "trace.jsonl").is_file() and (out / "latency_cdf.png").is_file()


# --- no server needed ----------------------------------------------------------------------------------------------
def test_target_text_parses_protocol_host_model_and_label():
    a = parse_triton_target("triton=grpc://127.0.0.1:9001")
    assert (a.protocol, a.host_port, a.model, a.label) == ("grpc", "127.0.0.1:9001", "pipeline",
                                                           "triton=grpc://127.0.0.1:9001/pipeline")
    b = parse_triton_target("triton:classic=http://server/sd15")
    assert (b.protocol, b.host_port, b.model, b.label) == ("http", "server:8000", "sd15", "classic")
    assert parse_triton_target("triton=grpc://[::1]:8001/m").host_port == "[::1]:8001"
    name, make = server_target("triton:fast=grpc://h:1/m")
    assert name == "fast" and isinstance(make(), TritonTarget)
    name, make = server_target("mine=http://127.0.0.1:8000")  # stepserve's own API, as before
    assert name == "mine" and make().base == "http://127.0.0.1:8000"


@pytest.mark.parametrize(("text", "message"), [("triton=ftp://h:1", "scheme must be grpc:// or http://"),
                                               ("triton=h:8001", "scheme must be grpc:// or http://"),
                                               ("triton=grpc://h:port", "port is not a number"),
                                               ("triton=grpc://h:1/a/b", "path may only name the model")])
def test_bad_target_text_is_a_one_line_usage_error(text, message, capsys):
    with pytest.raises(UsageError, match=message):
        config_from_args(["--target", text])
    assert main(["--target", text]) == 2
    assert message in capsys.readouterr().err


def test_request_tensors_leave_optional_inputs_out_and_fill_required_defaults():
    config = {"input": [{"name": n} for n in ("prompt", "seed", "steps", "guidance_scale")]
              + [{"name": n, "optional": True} for n in ("negative_prompt", "sampler", "height", "width")],
              "max_batch_size": 8}
    model = ModelInputs.from_config(config)
    assert not model.decoupled and model.optional == {"negative_prompt", "sampler", "height", "width"}
    sent = {n: v for n, _, v in request_tensors(RequestSpec("p", seed=3), model)}
    assert sent == {"prompt": "p", "seed": 3, **FALLBACK_DEFAULTS}
    full = RequestSpec("p", 3, 20, 7.5, "euler", 32, 48, "blurry")
    types = {n: t for n, t, _ in request_tensors(full, model)}
    assert types == {"prompt": "BYTES", "negative_prompt": "BYTES", "seed": "INT64", "steps": "INT32",
                     "guidance_scale": "FP32", "sampler": "BYTES", "height": "INT32", "width": "INT32"}
    optional_all = ModelInputs.from_config({**config, "input": [{"name": n["name"], "optional": True}
                                                                for n in config["input"]],
                                            "model_transaction_policy": {"decoupled": True}})
    assert optional_all.decoupled
    assert {n for n, _, _ in request_tensors(RequestSpec("p", seed=3), optional_all)} == {"prompt", "seed"}
