"""An edit's upload within bounds: a body declared or streamed past the limit is refused before the rest is read
(the test counts what the app read from its ASGI receive, and a raw socket sees the 413 with most of its body
unsent); text fields are small; a picture larger than the model makes is refused from its header, never decoded
(and the server's memory barely moves); pictures are decoded off the event loop and converted once; a deeply
nested field is a 400; a client gone while the form is read is cancelled; a keyless server refuses another site's
form post."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import socket
import struct
import threading
import zlib

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageFile

from conftest import ServerThread
from server_helpers import assert_error_shape
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.loading import load_executor
from stepserve.server.app import create_app

EDITS = "/v1/images/edits"
LIMIT = 33 * 2**20  # ServerLimits().max_upload_bytes
BOUNDARY = "b0undary"
QUICK = {"prompt": "seven", "num_inference_steps": "2", "strength": "1.0"}


def embedded_app(**options):
    return create_app(AsyncEngine(load_executor("embedded"), strategy="continuous"), **options)


@pytest.fixture(scope="module")
def client():
    with TestClient(embedded_app(cors_origins=["https://app.example"])) as c:
        yield c


def png(size: int = 32, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="PNG")
    return out.getvalue()


def bomb_png(side: int = 13000) -> bytes:
    """A valid 1-bit PNG of side x side black pixels: some 30 KB that decode to side² pixels (13000: 169 MB in
    Pillow's 1-bit mode, 507 MB as RGB). Built row by row, so the test never holds the pixels."""
    row, packer = b"\x00" * (1 + (side + 7) // 8), zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # bit depth 1, grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def part_head(name: str, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    kind = "\r\nContent-Type: image/png" if filename else ""
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}{kind}\r\n\r\n".encode()


def post_asgi(client: TestClient, chunks, headers: dict[str, str], cap: int) -> tuple[int, bytes, int]:
    """POST straight into the app over ASGI, the body from `chunks` (more to come after each); once the app has
    read `cap` bytes (or the chunks run out) the client is gone. -> (status, body, bytes the app read)."""
    read, sent = 0, []

    async def receive():
        nonlocal read
        chunk = next(chunks, None) if read < cap else None
        if chunk is None:
            return {"type": "http.disconnect"}
        read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": EDITS, "raw_path": EDITS.encode(), "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
             "headers": [(k.lower().encode(), v.encode()) for k, v in
                         {"host": "testserver", "content-type": f"multipart/form-data; boundary={BOUNDARY}",
                          **headers}.items()]}
    client.portal.call(client.app, scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), read


def an_endless_image():
    yield part_head("image", "big.png")
    while True:
        yield b"\x00" * 2**18


def test_a_declared_300_mb_upload_is_refused_before_any_of_it_is_read(client):
    status, body, read = post_asgi(client, an_endless_image(), {"content-length": str(300 * 10**6)}, cap=16 * 10**6)
    assert status == 413 and b"33 MiB" in body, body
    assert read == 0


def test_a_streamed_body_without_a_length_is_refused_once_it_passes_the_limit(client):
    status, body, read = post_asgi(client, an_endless_image(), {}, cap=LIMIT + 16 * 2**20)
    assert status == 413 and b"body_too_large" in body, body
    assert LIMIT < read <= LIMIT + 2**18 + 200  # the chunk that passed the limit was the last one read


def test_a_real_server_answers_413_while_most_of_a_declared_body_is_unsent():
    with ServerThread(embedded_app()) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(120)  # a failure bound only: the answer comes as soon as the headers are read
        sock.sendall((f"POST {EDITS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {300 * 10**6}\r\n"
                      f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n").encode()
                     + part_head("image", "big.png") + b"\x00" * 2**20)  # 1 MB sent of 300
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def form(files: dict[str, bytes], fields: dict[str, str]) -> tuple[dict, dict]:
    return {k: (f"{k}.png", v, "image/png") for k, v in files.items()}, fields


def test_text_fields_are_small(client):
    files, data = form({"image": png()}, {**QUICK, "user": "x" * (100 * 1024)})
    error = assert_error_shape(client.post(EDITS, files=files, data=data), 400)
    assert "text field at most 64 KiB" in error["message"], error


class Decoding:
    """Records every picture Pillow decodes (its size, and whether an event loop runs in the thread that does it)
    and every conversion to RGB (the size and mode it started from)."""

    def __init__(self, monkeypatch) -> None:
        self.loads, self.to_rgb = [], []
        load, convert = ImageFile.ImageFile.load, Image.Image.convert

        def spied_load(image):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            self.loads.append((image.size, on_loop))
            return load(image)

        def spied_convert(image, mode=None, *args, **kwargs):
            if mode == "RGB":
                self.to_rgb.append((image.size, image.mode))
            return convert(image, mode, *args, **kwargs)

        monkeypatch.setattr(ImageFile.ImageFile, "load", spied_load)
        monkeypatch.setattr(Image.Image, "convert", spied_convert)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_during(action) -> tuple[object, int]:
    """(what action() returned, the largest RSS growth seen while it ran), sampled every millisecond."""
    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss() - base)
            done.wait(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = action()
    finally:
        done.set()
        sampler.join()
    return result, max(peak[0], rss() - base)


@pytest.mark.parametrize("field", ["image", "mask"])
def test_a_picture_larger_than_the_model_makes_is_refused_from_its_header(client, monkeypatch, field):
    bomb = bomb_png()
    assert len(bomb) < 100_000
    files = {"image": bomb, "mask": png()} if field == "image" else {"image": png(), "mask": bomb}
    decoding = Decoding(monkeypatch)
    answer, grown = peak_rss_during(lambda: client.post(EDITS, files=form(files, QUICK)[0], data=QUICK))
    error = assert_error_shape(answer, 400)
    assert error["param"] == field and error["message"].startswith(f"{field}: 13000x13000"), error
    assert "at most 4096" in error["message"], error  # a phone photo fits; the embedded model makes 32x32
    assert (13000, 13000) not in [size for size, _ in decoding.loads]  # never decoded
    assert grown < 100 * 2**20, f"the server's memory grew by {grown / 2**20:.0f} MiB"


def test_pictures_are_decoded_off_the_event_loop_and_converted_once(client, monkeypatch):
    decoding = Decoding(monkeypatch)
    files, data = form({"image": png(mode="L"), "mask": png(mode="L")}, QUICK)
    assert client.post(EDITS, files=files, data=data).status_code == 200
    decoded = [on_loop for size, on_loop in decoding.loads if size == (32, 32)]
    assert len(decoded) >= 2 and not any(decoded)  # the image and the mask (and no-op loads by conversions)
    assert decoding.to_rgb == [((32, 32), "L")]  # the grayscale upload, once; the RGB copy is never re-converted


def test_a_deeply_nested_field_is_a_400(client):
    files, data = form({"image": png()}, {**QUICK, "cache": "[" * 50_000})
    error = assert_error_shape(client.post(EDITS, files=files, data=data), 400)
    assert error["param"] == "cache" and "nested too deeply" in error["message"], error


def test_a_client_gone_while_the_form_is_read_is_cancelled(client, caplog):
    caplog.set_level(logging.INFO, logger="stepserve.access")
    metrics = client.app.state.server.metrics
    before = metrics.requests.labels("cancelled")._value.get()
    parts = iter([part_head("prompt") + b"seven\r\n", part_head("image", "a.png") + png()[:100]])
    status, _, _ = post_asgi(client, parts, {}, cap=LIMIT)
    assert status == 499
    assert metrics.requests.labels("cancelled")._value.get() == before + 1
    assert [r.getMessage().split(" ")[:4] for r in caplog.records if r.name == "stepserve.access"] == [
        ["POST", EDITS, "499", "cancelled"]]


@pytest.mark.parametrize("headers,status", [
    ({"Origin": "https://evil.example"}, 403),
    ({"Origin": "null"}, 403),  # a sandboxed page or a file
    ({"Sec-Fetch-Site": "cross-site"}, 403),
    ({"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}, 200),  # the server's own page
    ({"Origin": "https://app.example"}, 200),  # allowed with --cors-origin
    ({}, 200),  # not a browser: the official clients send no Origin
])
def test_a_keyless_server_refuses_another_sites_form_post(client, headers, status):
    files, data = form({"image": png()}, QUICK)
    answer = client.post(EDITS, files=files, data=data, headers=headers)
    assert answer.status_code == status, answer.text
    if status == 403:
        error = assert_error_shape(answer)
        assert error["code"] == "cross_site_request" and "--api-key" in error["message"], error


def test_with_an_api_key_the_key_decides_not_the_origin():
    with TestClient(embedded_app(api_key="k")) as c:
        files, data = form({"image": png()}, QUICK)
        cross = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
        assert c.post(EDITS, files=files, data=data, headers=cross).status_code == 401
        keyed = c.post(EDITS, files=files, data=data, headers={**cross, "Authorization": "Bearer k"})
        assert keyed.status_code == 200, keyed.text
