"""A bench Target that starts its peer server, drives it over HTTP (stepserve's images API) or KServe v2 (Triton),
and stops it with every process it started. One fresh server per run, like the in-process contenders' fresh
engines; its start-up (warm-up requests included) is the run's engine_start_s, never inside a number."""

from __future__ import annotations

import asyncio
import base64
import io

from ..targets import FAILED, IMAGES_PATH, OK, HttpTarget, Reply, StepSample, reply_from_body
from ..workload import RequestSpec
from .registry import PeerContext, PeerSetting, launch


class _HttpImagesTarget(HttpTarget):
    """HttpTarget that, when asked to keep images, decodes the first image of each 200 answer."""

    def __init__(self, url: str, name: str, keep_images: bool) -> None:
        super().__init__(url, name)
        self.keep_images = keep_images

    async def send(self, spec: RequestSpec) -> Reply:
        if not self.keep_images:
            return await super().send(spec)
        import aiohttp
        from PIL import Image

        try:
            async with self._session.post(self.base + IMAGES_PATH, json=spec.to_http()) as resp:
                if resp.status != 200:
                    return Reply(FAILED, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
                body = await resp.json()
        except aiohttp.ClientError as exc:
            return Reply(FAILED, error=f"{type(exc).__name__}: {exc}")
        reply = reply_from_body(body)
        reply.image = Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))
        reply.image.load()
        return reply


async def _start_process(process) -> None:
    """process.start() in a thread. Cancelled (Ctrl-C or SIGTERM during start-up), it tells the start to give up
    and waits until the start has stopped everything it launched, then lets the cancellation go on."""
    starting = asyncio.ensure_future(asyncio.to_thread(process.start))
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        process.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        raise


class PeerTarget:
    """One run of one contender: start() launches the server (in a thread: it takes seconds) and connects."""

    _runs = 0  # numbers each run's folder under the context's workdir

    def __init__(self, setting: PeerSetting, ctx: PeerContext, keep_images: bool = False) -> None:
        self.setting, self.ctx, self.keep_images = setting, ctx, keep_images
        self.name = setting.name
        self.launch = None
        self.client = None

    async def start(self) -> None:
        PeerTarget._runs += 1
        self.launch = launch(self.setting, self.ctx, PeerTarget._runs)
        try:
            await _start_process(self.launch.process)
            if self.launch.protocol == "triton":
                from ..triton_target import TritonTarget, parse_triton_target

                self.client = TritonTarget(parse_triton_target(f"triton:{self.name}={self.launch.url}"),
                                           self.keep_images)
            else:
                self.client = _HttpImagesTarget(self.launch.url, self.name, self.keep_images)
            await self.client.start()
            await self._warm_up()
        except BaseException:
            await self.stop()
            raise

    async def _warm_up(self) -> None:
        """One request alone, then a full batch at once: a fresh server's first calls (lazy loading, the first
        onnxruntime/torch runs at each batch size) must not land in the measured runs."""
        from .process import PeerError

        batch = self.setting.max_batch_size
        for group in ([0], range(1, 1 + batch)):
            replies = await asyncio.gather(*(self.client.send(RequestSpec("warm-up", seed=i, num_inference_steps=2))
                                             for i in group))
            failed = [r for r in replies if r.status != OK]
            if failed:
                raise PeerError(f"{self.name}: a warm-up request failed: {failed[0].error}")

    async def send(self, spec: RequestSpec) -> Reply:
        return await self.client.send(spec)

    async def stop(self) -> None:
        try:
            if self.client is not None:
                await self.client.stop()
        finally:
            self.client = None
            if self.launch is not None:
                await asyncio.to_thread(self.launch.process.stop)

    def step_samples(self) -> list[StepSample]:
        return []

    async def busy_seconds(self) -> float | None:
        """stepserve serve says from its /metrics; the other peers do not (None)."""
        if self.setting.peer == "stepserve" and self.client is not None:
            return await self.client.busy_seconds()
        return None
