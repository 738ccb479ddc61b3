"""Webhooks that would reach inside are refused when the job is made (400 naming `webhook`): loopback, link-local
(the cloud's metadata service), private, shared, multicast, unspecified and reserved addresses, IPv4 or IPv6 (an
IPv4 address inside an IPv6 one too), and names that resolve to any of them; a public address or name is accepted;
--webhook-allow names internal receivers. No test here connects anywhere: the sender's POST is replaced, and names
resolve through the test's own resolver."""

from __future__ import annotations

import ipaddress
import json

import pytest
from job_helpers import app_client, wait_job
from jobs.test_webhook_sender import Receiver
from server.server_helpers import assert_error_shape, wait_until

import stepserve.jobs.targets as targets
import stepserve.jobs.webhooks as webhooks
from stepserve.engine.loading import load_executor
from stepserve.jobs.targets import WebhookTargetError, WebhookTargets, is_public, parse_allow
from stepserve.store.memory import MemoryStore

GENERATIONS, ASYNC, SECRET = "/v1/images/generations", {"Prefer": "respond-async"}, "s3cret"
PUBLIC = "93.184.215.14"
NAMES = {"hooks.example": [PUBLIC], "inside.example": [PUBLIC, "10.1.2.3"], "rebound.example": ["127.0.0.1"]}
INTERNAL = ["127.0.0.1", "169.254.169.254", "10.0.0.1", "[::1]", "localhost", "100.64.0.1", "192.168.1.1",
            "172.16.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "240.0.0.1", "[::ffff:127.0.0.1]", "[fe80::1]",
            "[fc00::1]", "[::]", "[ff02::1]", "[64:ff9b::a9fe:a9fe]", "[2002:7f00:1::]", "inside.example",
            "rebound.example"]


@pytest.fixture(scope="module")
def embedded():
    return load_executor("embedded")


@pytest.fixture
def no_traffic(monkeypatch):
    """Names resolve from NAMES ("localhost" too); a POST is recorded, never made."""
    posted = []

    def resolve(host, port):
        if host == "localhost":
            return ["127.0.0.1", "::1"]
        if host not in NAMES:
            raise OSError("no such name")
        return NAMES[host]

    async def post(url, addresses, body, headers, timeout_s):
        posted.append((url, addresses))
        return 204

    monkeypatch.setattr(targets, "resolve_host", resolve)
    monkeypatch.setattr(webhooks, "post_pinned", post)
    return posted


@pytest.mark.parametrize("host", INTERNAL)
def test_a_webhook_that_reaches_inside_is_refused_at_creation(embedded, no_traffic, host):
    store = MemoryStore()
    with app_client(embedded, store=store, webhook_secret=SECRET) as c:
        answer = c.post(GENERATIONS, json={"prompt": "a", "webhook": f"http://{host}:8080/hook"}, headers=ASYNC)
    error = assert_error_shape(answer, 400)
    assert error["param"] == "webhook" and error["code"] == "webhook_not_allowed", error
    assert "webhooks are sent only to public addresses" in error["message"] and "--webhook-allow" in error["message"]
    assert "10.1.2.3" not in error["message"]  # what a name resolves to stays inside
    assert store.list_jobs() == [] and no_traffic == []


def test_a_public_webhook_is_accepted_and_sent_to_the_address_checked(embedded, no_traffic):
    with app_client(embedded, webhook_secret=SECRET) as c:
        jobs = [c.post(GENERATIONS, json={"prompt": "a", "num_inference_steps": 2, "webhook": url}, headers=ASYNC)
                for url in (f"https://{PUBLIC}/hook", "https://hooks.example/hook")]
        assert [j.status_code for j in jobs] == [202, 202]
        for job in jobs:
            assert wait_job(c, f"/v1/images/jobs/{job.json()['id']}")["status"] == "completed"
        unknown = c.post(GENERATIONS, json={"prompt": "a", "webhook": "https://nowhere.example/x"}, headers=ASYNC)
    # a name that does not resolve is told as one that resolves inside: the answer maps nothing
    assert "'nowhere.example' does not resolve to public addresses only" in assert_error_shape(unknown, 400)["message"]
    assert sorted(no_traffic) == [(f"https://{PUBLIC}/hook", [PUBLIC]), ("https://hooks.example/hook", [PUBLIC])]


def test_webhook_allow_names_internal_receivers(embedded, no_traffic):
    allowed = WebhookTargets.allowing(["10.0.0.0/8", "Inside.Example.", "fd00::1"])
    assert allowed.addresses("http://10.9.8.7/x") == ["10.9.8.7"]
    assert allowed.addresses("http://inside.example/x") == [PUBLIC, "10.1.2.3"]  # every address of an allowed name
    assert allowed.addresses("http://[fd00::1]/x") == ["fd00::1"]
    for url in ("http://192.168.0.1/x", "http://[fd00::2]/x", "http://localhost/x"):
        with pytest.raises(WebhookTargetError, match="only to public addresses"):
            allowed.addresses(url)
    store = MemoryStore()
    with app_client(embedded, store=store, webhook_secret=SECRET, webhook_allow=["127.0.0.1"]) as c:
        ok = c.post(GENERATIONS, json={"prompt": "a", "webhook": "http://127.0.0.1:9/hook"}, headers=ASYNC)
        assert ok.status_code == 202
        assert store.get_delivery(ok.json()["id"]) is not None  # parked with the job, in case its end is cut short
    with pytest.raises(ValueError, match="--webhook-allow 'not a host!'.*CIDR form"):
        parse_allow("not a host!")


def test_what_is_public():
    public = ["93.184.215.14", "8.8.8.8", "2606:4700::1111"]
    inside = ["100.127.255.254", "198.18.0.1", "192.0.2.1", "::ffff:10.0.0.1", "2001:db8::1", "fec0::1",
              "2001:0:4136:e378:8000:63bf:3fff:fdd2"]  # the last: Teredo, its client 192.0.2.45
    assert [is_public(ipaddress.ip_address(a)) for a in public] == [True] * 3
    assert [is_public(ipaddress.ip_address(a)) for a in inside] == [False] * len(inside)


def test_an_allowed_internal_receiver_gets_the_job_without_its_images(embedded):
    store = MemoryStore()
    with Receiver() as receiver, app_client(embedded, store=store, webhook_secret=SECRET,
                                            webhook_allow=["127.0.0.0/8"]) as c:
        job = c.post(GENERATIONS, json={"prompt": "a", "num_inference_steps": 2, "webhook": receiver.url},
                     headers=ASYNC).json()
        assert wait_until(lambda: store.get_job(job["id"]).webhook["state"] != "pending", 240)
        shown = c.get(f"/v1/images/jobs/{job['id']}").json()
    [(_, headers, body)] = receiver.got
    sent = json.loads(body)
    assert sent["type"] == "image.completed" and sent["data"]["id"] == job["id"] and "result" not in sent["data"]
    assert shown["result"]["data"][0]["b64_json"] and len(body) < 2000  # the images stay with the job
    assert (shown["webhook"]["state"], shown["webhook"]["last_status"]) == ("delivered", 200)
    record = store.get_job(job["id"])
    assert "webhook_body" not in record.meta and store.get_delivery(job["id"]) is None
