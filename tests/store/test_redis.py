"""The Redis store's own promises (the contract itself is tests/store/test_contract.py), against real redis-servers:
keys under a prefix, no password in its URL or errors, a clear error for a server that cannot be reached, and the
extra named when the redis package is missing."""

from __future__ import annotations

import sys

import pytest
from extras import require
from redis_server import _free_port, redis_url, running_redis  # noqa: F401  (redis_url: a fixture)

from stepserve.store import AdapterRecord, JobRecord, StoreError, open_store
from stepserve.store.redis import RedisStore, without_password
from stepserve.util.extras import MissingExtraError


def use_everything(store: RedisStore) -> None:
    t = store.now()
    store.create_job(JobRecord(id="j", kind="video", request={}, created_at=t, idempotency_key="k"))
    store.create_job(JobRecord(id="done", kind="image", request={}, created_at=t, status="completed",
                               completed_at=t))
    store.claim_job("A", lease_s=60)
    store.register_adapter(AdapterRecord(name="anime", path="anime", registered_at=t))
    store.publish("replica-1", {"jobs": 1}, ttl_s=60)


def test_keys_stay_under_the_prefix_and_prefixes_share_one_database(redis_url):  # noqa: F811
    import redis

    url = redis_url.rsplit("/", 1)[0] + "/9"  # a database of this test's own
    client = redis.Redis.from_url(url, decode_responses=True)
    client.flushdb()
    client.set("someone-else:key", "theirs")
    ours, theirs = RedisStore(url), RedisStore(url, prefix="other:")
    use_everything(ours)
    keys = set(client.keys("*"))
    assert "stepserve:job:j" in keys and "stepserve:idem:k" in keys
    assert {k for k in keys if not k.startswith("stepserve:")} == {"someone-else:key"}
    assert (theirs.list_jobs(), theirs.adapters(), theirs.replicas(), theirs.get_job("j")) == ([], [], {}, None)
    assert theirs.claim_job("B", lease_s=60) is None and theirs.sweep(ours.now() + 1) == []
    assert [j.id for j in ours.sweep(ours.now() + 1)] == ["done"]
    assert client.get("someone-else:key") == "theirs"
    for store in (ours, theirs):
        store.close()
    client.close()


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@host:6379/0", "redis://host:6379/0"),
    ("redis://alice:s3cret@host:6379/2", "redis://alice@host:6379/2"),
    ("rediss://host:6380/0?password=s3cret&ssl_cert_reqs=none", "rediss://host:6380/0?ssl_cert_reqs=none"),
    ("redis://host", "redis://host"),
])
def test_a_url_is_shown_without_its_password(url, shown):
    assert without_password(url) == shown


def test_the_password_never_appears_in_the_url_or_an_error(redis_url, tmp_path):  # noqa: F811
    with running_redis(tmp_path, "--requirepass", "s3cret-pw") as url:
        where = url.split("//", 1)[1].rsplit("/", 1)[0]  # 127.0.0.1:PORT
        store = open_store(url.replace("//", "//:s3cret-pw@"))
        assert store.url == url and "s3cret" not in repr(vars(store))
        store.create_job(JobRecord(id="j", kind="video", request={}, created_at=store.now()))
        assert store.get_job("j").id == "j"
        store.close()
        for wrong in (url.replace("//", "//:wrong-pw@"), url + "?password=wrong-pw", url):
            with pytest.raises(StoreError) as caught:
                open_store(wrong)
            assert f"Redis at {where}" in str(caught.value) and "wrong-pw" not in str(caught.value)


def test_a_server_that_cannot_be_reached_is_one_clear_error_naming_host_and_port():
    require("redis", "redis")
    port = _free_port()  # nothing listens there
    with pytest.raises(StoreError, match=rf"state redis://127\.0\.0\.1:{port}/0: cannot reach Redis at "
                                         rf"127\.0\.0\.1:{port}: .*refused"):
        open_store(f"redis://127.0.0.1:{port}/0")


def test_without_the_redis_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # as if it were not installed
    with pytest.raises(MissingExtraError, match=r"--state redis://\.\.\. needs the 'redis' extra: "
                                                r"pip install 'stepserve\[redis\]'"):
        open_store("redis://127.0.0.1:6379/0")
