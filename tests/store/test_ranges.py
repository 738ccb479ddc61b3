"""HTTP Range on results (an MP4 for a browser's <video>): the job routes serve result files with Starlette's
FileResponse, which answers Range itself. These tests hold the installed Starlette to what those routes rely on,
so that an upgrade that breaks it is caught here: a file the size of a short MP4, read in ranges that cross
FileResponse's 64 KiB chunks."""

from __future__ import annotations

import random

import pytest
from starlette.applications import Starlette
from starlette.responses import FileResponse
from starlette.routing import Route
from starlette.testclient import TestClient

SIZE = 3 * 1024 * 1024 + 17  # a few seconds of a small MP4, not a multiple of the chunk size


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("results") / "video.mp4"
    data = random.Random(0).randbytes(SIZE)
    path.write_bytes(data)
    app = Starlette(routes=[Route("/content", lambda request: FileResponse(path, media_type="video/mp4"))])
    with TestClient(app) as client:
        yield client, data


def test_a_whole_file_says_that_it_takes_ranges(served):
    client, data = served
    answer = client.get("/content")
    assert answer.status_code == 200 and answer.content == data
    assert answer.headers["accept-ranges"] == "bytes" and answer.headers["content-length"] == str(SIZE)


@pytest.mark.parametrize("header, first, last", [
    ("bytes=0-99", 0, 99),
    ("bytes=65530-200000", 65530, 200000),  # across chunk boundaries
    ("bytes=1048576-", 1048576, SIZE - 1),  # from an offset to the end (a seek)
    ("bytes=-500", SIZE - 500, SIZE - 1),  # the last n bytes (where an MP4 may keep its index)
    (f"bytes={SIZE - 10}-{SIZE + 1000}", SIZE - 10, SIZE - 1),  # an end past the file: up to its end
])
def test_a_range_is_answered_with_206_and_exactly_those_bytes(served, header, first, last):
    client, data = served
    answer = client.get("/content", headers={"Range": header})
    assert answer.status_code == 206
    assert answer.headers["content-range"] == f"bytes {first}-{last}/{SIZE}"
    assert answer.headers["content-length"] == str(last - first + 1)
    assert answer.headers["content-type"] == "video/mp4"
    assert answer.content == data[first:last + 1]


@pytest.mark.parametrize("header", [f"bytes={SIZE}-", f"bytes={SIZE + 5}-{SIZE + 9}", "bytes=-0"])
def test_a_range_past_the_end_is_416_with_the_size(served, header):
    client, _ = served
    answer = client.get("/content", headers={"Range": header})
    assert answer.status_code == 416
    assert answer.headers["content-range"] == f"bytes */{SIZE}" and answer.content == b""
