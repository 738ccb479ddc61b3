"""DNS rebinding: a keyless server answers only the Host names of the address it listens on (and --allowed-host);
any other Host is a 403 in the OpenAI shape. With an API key every Host is served. (server/hosts.py)"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from server_helpers import assert_error_shape

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.loading import load_executor
from stepserve.server.app import create_app
from stepserve.server.hosts import ServedHosts


@pytest.fixture(scope="module")
def embedded():
    return load_executor("embedded")


def client(executor, **options) -> TestClient:
    engine = AsyncEngine(executor, strategy="continuous", max_batch_size=2)
    return TestClient(create_app(engine, **options), base_url="http://localhost:8000")


def test_a_keyless_server_on_loopback_answers_only_its_own_names(embedded):
    with client(embedded, listen_host="127.0.0.1") as c:
        for host in ("localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST."):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.2", "[::2]"):
            error = assert_error_shape(c.get("/v1/models", headers={"Host": host}), 403)
            assert error["code"] == "host_not_allowed" and "--allowed-host" in error["message"], host
        refused = c.post("/v1/images/generations", json={"prompt": "a"}, headers={"Host": "evil.example"})
        assert refused.status_code == 403
        assert c.get("/health", headers={"Host": "evil.example"}).status_code == 200  # probed by address


def test_allowed_host_and_an_api_key(embedded):
    with client(embedded, listen_host="127.0.0.1", allowed_hosts=("images.example",)) as c:
        assert c.get("/v1/models", headers={"Host": "Images.Example:443"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403
    with client(embedded, listen_host="127.0.0.1", api_key="k") as c:  # a page cannot send the key
        answer = c.get("/v1/models", headers={"Host": "evil.example", "Authorization": "Bearer k"})
        assert answer.status_code == 200


def test_the_names_of_each_listen_address():
    everywhere = ServedHosts.of("0.0.0.0", machine="gpu-box-7")
    assert everywhere.serves("10.1.2.3:8000") and everywhere.serves("[fd00::1]") and everywhere.serves("localhost")
    assert everywhere.serves("GPU-box-7:8000")  # the machine's own name
    assert not everywhere.serves("evil.example") and not everywhere.serves(None)
    one = ServedHosts.of("10.1.2.3", ["api.internal"], machine="gpu-box-7")
    assert one.serves("10.1.2.3:80") and one.serves("api.internal") and not one.serves("localhost")
    assert not ServedHosts.of("127.0.0.1", machine="gpu-box-7").serves("gpu-box-7")  # on loopback: not reachable so
    assert not one.serves("10.1.2.4")
    assert ServedHosts.of("::1").serves("[::1]:8000") and ServedHosts.of("::1").serves("localhost")
    assert ServedHosts.of("10.1.2.3", ["*"]).serves("anything.example")
