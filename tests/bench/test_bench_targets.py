"""The HTTP target speaks the OpenAI images shape: 200 with stepserve's timing, 429 as a rejection."""

import asyncio

from aiohttp import web

from stepserve.bench.targets import FAILED, OK, REJECTED, HttpTarget, reply_from_body
from stepserve.bench.workload import RequestSpec


async def _serve(handler):
    app = web.Application()
    app.router.add_post("/v1/images/generations", handler)
    metrics = ('# HELP x\nstepserve_step_latency_seconds_bucket{le="0.1"} 3.0\n'
               "stepserve_step_latency_seconds_sum 12.5\n")
    app.router.add_get("/metrics", lambda r: web.Response(text=metrics))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_http_target_statuses_and_timing():
    seen = []

    async def handler(request):
        body = await request.json()
        seen.append(body)
        if body["seed"] == 1:
            return web.json_response({"error": {"message": "over capacity", "type": "rate_limit", "param": None,
                                                "code": "429"}}, status=429, headers={"Retry-After": "1"})
        if body["seed"] == 2:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.json_response({"created": 1, "data": [{"b64_json": ""}],
                                  "stepserve": {"model": "m", "images": [
                                      {"queue_s": 0.1, "denoise_s": 0.2, "decode_s": 0.01, "batch_sizes": [1, 2]}]}})

    async def main():
        runner, url = await _serve(handler)
        target = HttpTarget(url + "/v1/images/generations", "srv")
        await target.start()
        try:
            replies = [await target.send(RequestSpec("a one", seed, num_inference_steps=8)) for seed in (0, 1, 2)]
            busy = await target.busy_seconds()
        finally:
            await target.stop()
            await runner.cleanup()
        return replies, busy

    (ok, rejected, failed), busy = asyncio.run(main())
    assert ok.status == OK and ok.queue_s == 0.1 and ok.denoise_s == 0.2 and ok.batch_sizes == [1, 2]
    assert rejected.status == REJECTED and rejected.error == "over capacity"
    assert failed.status == FAILED and "500" in failed.error and "boom" in failed.error
    assert busy == 12.5
    assert seen[0]["num_inference_steps"] == 8 and seen[0]["n"] == 1


def test_reply_without_timing_field_and_flat_timing():
    reply = reply_from_body({"created": 1, "data": [{"b64_json": ""}]})
    assert reply.status == OK and reply.queue_s is None and reply.batch_sizes == []
    assert reply_from_body({"stepserve": {"queue_ms": 100, "batch_sizes": [3]}}).queue_s == 0.1


def test_unreadable_metrics_are_logged_once_not_swallowed(monkeypatch, caplog):
    import logging
    import socket

    from stepserve.bench import logs

    monkeypatch.setattr(logs, "_said", set())
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        target = HttpTarget(f"http://127.0.0.1:{port}")
        await target.start()
        try:
            return [await target.busy_seconds() for _ in range(3)]
        finally:
            await target.stop()

    with caplog.at_level(logging.DEBUG, logger="stepserve.bench.targets"):
        assert asyncio.run(main()) == [None, None, None]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "busy time not read" in warnings[0].getMessage() and f":{port}/metrics" in warnings[0].getMessage()
    assert "ClientConnectorError" in warnings[0].getMessage()
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 2  # the repeats, quietly


def test_error_message_falls_back_to_the_text():
    from stepserve.bench.targets import _error_message

    assert _error_message('{"error": {"message": "over capacity"}}') == "over capacity"
    for text in ("<html>502</html>", "[1, 2]", '{"error": "x"}', '{"detail": "x"}'):
        assert _error_message(text) == text
