"""The webhook sender against a real receiver on loopback (allowed as an operator allows an internal receiver):
exactly one verified delivery per job; 500 twice then 200 is three attempts and one success; a receiver down
throughout ends the retries (failed, the job still completed, no socket error's text in its state); a delivery a
dead sender left in the outbox is taken up once its lease has passed, with the same id and body; redirects are not
followed; nothing is sent unsigned; verify() refuses a tampered body, an old timestamp, another secret. (The outbox
races and the address checks at send time: test_webhook_outbox.py.)"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stepserve.jobs.targets import WebhookTargets
from stepserve.jobs.webhooks import (WebhookSecretError, WebhookSender, WebhookVerificationError, require_secret,
                                     sign, verify)
from stepserve.store.base import COMPLETED, FAILED, JobRecord
from stepserve.store.memory import MemoryStore

from server.server_helpers import wait_until
from store.redis_server import redis_url  # noqa: F401  (a fixture)
from store.store_backends import Clock, open_backend

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
QUICK = (0.01, 0.01, 0.01)  # the retries' delays in these tests
HANG_S = 60.0  # a bound on a hang only
LOOPBACK = WebhookTargets.allowing(["127.0.0.0/8"])  # serve --webhook-allow 127.0.0.0/8: the receivers below


def sender(store, secret=SECRET, **options) -> WebhookSender:
    return WebhookSender(store, secret, targets=LOOPBACK, **options)


@pytest.fixture(params=("memory", "sqlite", "redis"))
def store(request, tmp_path):
    """The state store the jobs are in, of each backend (Redis: a real redis-server, a key prefix of its own)."""
    location, prefix = "", ""
    if request.param == "sqlite":
        location = str(tmp_path / "state.db")
    elif request.param == "redis":
        location, prefix = request.getfixturevalue("redis_url"), f"hooks-{uuid.uuid4().hex[:8]}:"
    opened = open_backend(request.param, location, prefix)
    yield opened
    opened.close()


class Receiver:
    """An HTTP server on loopback that records every POST (path, headers, body) and answers the next of
    `statuses` (then 200)."""

    def __init__(self, statuses=()) -> None:
        self.statuses = list(statuses)
        self.got: list[tuple[str, dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.got.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", "/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def finished_job(store, job_id: str, url: str, status: str = COMPLETED) -> JobRecord:
    job, _ = store.create_job(JobRecord(job_id, "video", {"prompt": "a cat"}, store.now(), status=status,
                                        completed_at=store.now(), owner="runner", lease_until=store.now() + 30,
                                        webhook={"url": url, "state": "pending", "attempts": 0, "last_error": None}))
    return job


def payload(job: JobRecord) -> dict:
    return {"type": f"video.{job.status}", "timestamp": "2026-01-01T00:00:00Z", "data": {"id": job.id}}


def verified(got) -> list[dict]:
    """Every delivery verified (else it raises), as its payloads."""
    for _, headers, body in got:
        verify(SECRET, headers, body)
    return [json.loads(body) for _, _, body in got]


def test_exactly_one_verified_delivery_per_job(store):
    async def run(url):
        hooks = sender(store, delays_s=QUICK)
        jobs = [finished_job(store, f"job{i}", url, COMPLETED if i else FAILED) for i in range(3)]
        await asyncio.gather(*(hooks.deliver(j, payload(j), "runner") for j in jobs))
        await hooks.deliver(jobs[0], payload(jobs[0]), "runner")  # again: delivered already, never posted again
        await hooks.resume("another")
        await hooks.close()

    with Receiver() as receiver:
        asyncio.run(run(receiver.url))
    assert sorted(p["data"]["id"] for p in verified(receiver.got)) == ["job0", "job1", "job2"]
    assert sorted(h["webhook-id"] for _, h, _ in receiver.got) == ["msg_job0", "msg_job1", "msg_job2"]
    for i in range(3):
        job = store.get_job(f"job{i}")
        assert job.webhook["state"] == "delivered" and job.webhook["attempts"] == 1 and job.webhook["delivered_at"]
        assert job.status == (COMPLETED if i else FAILED)


def test_an_error_answer_is_retried_until_a_2xx(store):
    with Receiver([500, 500, 200]) as receiver:
        job = finished_job(store, "job", receiver.url)
        asyncio.run(sender(store, delays_s=QUICK).deliver(job, payload(job), "runner"))
    assert len(receiver.got) == 3 and verified(receiver.got) == [payload(job)] * 3
    assert {h["webhook-id"] for _, h, _ in receiver.got} == {"msg_job"}  # one delivery, retried
    hook = store.get_job("job").webhook
    assert (hook["state"], hook["attempts"], hook["last_error"], hook["last_status"]) == ("delivered", 3, None, 200)


def test_a_redirect_is_not_followed():
    store = MemoryStore()
    with Receiver([302]) as receiver:
        job = finished_job(store, "job", receiver.url)
        asyncio.run(sender(store, delays_s=(0.01,)).deliver(job, payload(job), "runner"))
    assert [path for path, _, _ in receiver.got] == ["/hook", "/hook"]  # retried where it was sent, never /elsewhere
    assert store.get_job("job").webhook["state"] == "delivered"


def test_a_receiver_down_throughout_ends_the_retries_and_the_job_stays_completed():
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/hook"
    store = MemoryStore()
    job = finished_job(store, "job", url)
    asyncio.run(sender(store, delays_s=QUICK).deliver(job, payload(job), "runner"))
    after = store.get_job("job")
    assert after.webhook["state"] == "failed" and after.webhook["attempts"] == len(QUICK) + 1
    assert after.webhook["last_error"] == "no answer" and after.webhook["last_status"] is None  # no socket text
    assert after.webhook["delivered_at"] is None
    assert (after.status, after.completed_at, after.results) == (job.status, job.completed_at, job.results)


@pytest.mark.parametrize("backend", ["memory", "sqlite"])  # on a clock the test moves (Redis keeps its own)
def test_a_delivery_left_by_a_dead_sender_is_resumed_once_its_lease_has_passed(backend, tmp_path):
    clock = Clock()
    store = open_backend(backend, str(tmp_path / "state.db"), clock=clock)

    async def run(receiver):
        job = finished_job(store, "job", receiver.url)
        first = sender(store, delays_s=(3600,), lease_s=30)
        dying = asyncio.ensure_future(first.deliver(job, payload(job), "proc-1"))
        await asyncio.to_thread(wait_until, lambda: store.get_job("job").webhook["attempts"] == 1, HANG_S)
        dying.cancel()  # the process died while waiting to retry
        await asyncio.gather(dying, return_exceptions=True)
        second = sender(store, delays_s=QUICK, lease_s=30)
        await second.resume("proc-2")
        assert len(receiver.got) == 1  # its lease still held: not taken yet
        clock.t += 31
        await second.resume("proc-2")
        await second.close()

    with Receiver([500]) as receiver, contextlib.closing(store):
        asyncio.run(run(receiver))
        assert store.get_delivery("job") is None  # delivered: out of the outbox
    bodies = [body for _, _, body in receiver.got]
    assert [h["webhook-id"] for _, h, _ in receiver.got] == ["msg_job", "msg_job"]
    assert bodies[0] == bodies[1]  # the same payload as the dead sender's attempt
    assert [p["data"]["id"] for p in verified(receiver.got)] == ["job", "job"]
    hook = store.get_job("job").webhook
    assert (hook["state"], hook["attempts"]) == ("delivered", 2)


def test_nothing_is_sent_unsigned():
    with pytest.raises(WebhookSecretError, match="--webhook-secret or STEPSERVE_WEBHOOK_SECRET"):
        require_secret(None)
    with pytest.raises(WebhookSecretError, match="not base64"):
        WebhookSender(MemoryStore(), "whsec_not base64!")
    require_secret(SECRET)
    store = MemoryStore()
    with Receiver() as receiver:
        job = finished_job(store, "job", receiver.url)
        asyncio.run(sender(store, None, delays_s=QUICK).deliver(job, payload(job), "runner"))
    assert receiver.got == []
    hook = store.get_job("job").webhook
    assert hook["state"] == "failed" and hook["attempts"] == 0 and "unsigned" in hook["last_error"]


def test_sign_and_verify_follow_the_specification():
    body, stamp = b'{"test": 2432232314}', 1614265330
    signature = sign(SECRET, "msg_p5jXN8AQM9LWM0D4loKWxJek", stamp, body)
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="  # the specification's test vector
    headers = {"Webhook-Id": "msg_p5jXN8AQM9LWM0D4loKWxJek", "Webhook-Timestamp": str(stamp),
               "Webhook-Signature": f"v1,bm90IGl0 {signature}"}  # any one of several signatures may match
    verify(SECRET, headers, body, now=stamp + 10)
    cases = [
        (SECRET, headers, b'{"test": 2432232315}', stamp, "no v1 signature matches"),  # tampered body
        (SECRET, headers, body, stamp + 301, "at most 300 s"),  # too old: a replay
        (SECRET, headers, body, stamp - 301, "at most 300 s"),  # from the future
        ("whsec_c2VjcmV0LW9mLWFub3RoZXI=", headers, body, stamp, "no v1 signature matches"),  # another secret
        (SECRET, {k: v for k, v in headers.items() if k != "Webhook-Signature"}, body, stamp, "webhook-signature"),
    ]
    for secret, hdrs, data, now, says in cases:
        with pytest.raises(WebhookVerificationError, match=says):
            verify(secret, hdrs, data, now=now)
    plain = {**headers, "Webhook-Id": "m", "Webhook-Signature": sign("plain secret", "m", stamp, body)}
    verify("plain secret", plain, body, now=stamp)  # a secret without whsec_: its UTF-8 bytes are the key
    verify("whsec_" + base64.b64encode(b"plain secret").decode(), plain, body, now=stamp)  # the same key
