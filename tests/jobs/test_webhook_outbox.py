"""Webhook deliveries as outbox records, and where they may go at send time: an internal receiver is never posted
to without --webhook-allow; a name that resolved public when the job was made and resolves to loopback when it is
sent (DNS rebinding) is never connected to, and the connection goes to the address just checked; two processes
never deliver one event; a sender holds its lease while a slow receiver answers; a delivery whose sender died
before its first attempt sends the body stored when the job ended, and one that died between the job's end and
storing the body leaves its delivery parked, taken up with the payload of the job's end; nothing of the payload
lands in the job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest

from stepserve.jobs.targets import WebhookTargetError, WebhookTargets
from stepserve.jobs.webhooks import REFUSED, WebhookSender, park, verify
from stepserve.store.base import COMPLETED, JobRecord
from stepserve.store.memory import MemoryStore
from stepserve.store.sqlite import SqliteStore

from jobs.test_webhook_sender import HANG_S, QUICK, SECRET, Receiver, finished_job, payload, sender
from server.server_helpers import wait_until
from store.store_backends import Clock

PUBLIC = "93.184.215.14"  # never connected to: every resolver below is the test's


def test_an_internal_receiver_is_refused_at_send_time_without_an_allowance():
    store = MemoryStore()
    with Receiver() as receiver:
        job = finished_job(store, "job", receiver.url)
        asyncio.run(WebhookSender(store, SECRET, delays_s=QUICK).deliver(job, payload(job), "runner"))
    assert receiver.got == []
    hook = store.get_job("job").webhook
    assert (hook["state"], hook["last_error"], hook["last_status"]) == ("failed", REFUSED, None)
    assert store.get_delivery("job") is None


def test_a_name_rebound_to_loopback_after_creation_is_never_connected_to():
    answers = [[PUBLIC], ["127.0.0.1"]]  # at creation, then at every attempt
    asked = []

    def resolve(host, port):
        asked.append(host)
        return answers[min(len(asked), 2) - 1]

    targets = WebhookTargets.allowing((), resolve=resolve)
    store = MemoryStore()
    with Receiver() as receiver:
        url = receiver.url.replace("127.0.0.1", "hooks.example")
        hooks = WebhookSender(store, SECRET, delays_s=QUICK, targets=targets)
        targets.addresses(url)  # the job is made: public then
        job = finished_job(store, "job", url)
        asyncio.run(hooks.deliver(job, payload(job), "runner"))
    assert receiver.got == [] and len(asked) == 1 + len(QUICK) + 1  # resolved again before every attempt
    assert store.get_job("job").webhook["last_error"] == REFUSED
    try:
        targets.addresses(url)
    except WebhookTargetError as exc:
        assert "'hooks.example' does not resolve to public addresses only" in str(exc) and "--webhook-allow" in str(exc)
        assert "127.0.0.1" not in str(exc) and "resolves to 127.0.0.1" in exc.detail  # the inside: the log's only
    else:
        raise AssertionError("a name resolving to loopback passed the check")


def test_the_connection_goes_to_the_checked_address_with_the_urls_host_name():
    targets = WebhookTargets.allowing(["127.0.0.0/8"], resolve=lambda host, port: ["127.0.0.1"])
    store = MemoryStore()
    with Receiver() as receiver:
        url = receiver.url.replace("127.0.0.1", "hooks.example")  # no such name in any real resolver
        job = finished_job(store, "job", url)
        asyncio.run(WebhookSender(store, SECRET, delays_s=QUICK, targets=targets).deliver(job, payload(job), "r"))
    [(_, headers, body)] = receiver.got
    assert headers["host"] == url.split("/")[2] and json.loads(body) == payload(job)
    verify(SECRET, headers, body)


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_two_processes_never_deliver_one_event(backend, tmp_path):
    store = MemoryStore()
    other = store  # the second process's view of the state: the same store, or its own connection to the file
    if backend == "sqlite":
        store, other = SqliteStore(tmp_path / "state.db"), SqliteStore(tmp_path / "state.db")

    async def run(url):
        job = finished_job(store, "job", url)
        first, second = sender(store, delays_s=QUICK), sender(other, delays_s=QUICK)
        await asyncio.gather(first.deliver(job, payload(job), "proc-1"), second.deliver(job, payload(job), "proc-2"),
                             first.resume("proc-1"), second.resume("proc-2"))

    with Receiver() as receiver:
        asyncio.run(run(receiver.url))
    assert len(receiver.got) == 1 and store.get_job("job").webhook["state"] == "delivered"


def test_a_slow_receiver_does_not_lose_the_lease_to_another_process():
    clock, answered, arrived = Clock(), threading.Event(), threading.Event()
    store = MemoryStore(clock)

    class Slow(Receiver):  # holds its first answer until the test lets it go
        def __init__(self):
            super().__init__()
            handler = self.server.RequestHandlerClass
            do_post = handler.do_POST

            def slow(this):
                arrived.set()
                answered.wait(HANG_S)
                do_post(this)

            handler.do_POST = slow

    async def run(url):
        job = finished_job(store, "job", url)
        first = sender(store, delays_s=QUICK, lease_s=0.3)
        sending = asyncio.ensure_future(first.deliver(job, payload(job), "proc-1"))
        await asyncio.to_thread(arrived.wait, HANG_S)
        for _ in range(3):  # the store's clock passes the lease three times over while the POST is answered
            until = store.get_delivery("job").lease_until
            clock.t = until - 0.05
            await asyncio.to_thread(wait_until, lambda: store.get_delivery("job").lease_until > until, HANG_S)
            await sender(store, delays_s=QUICK, lease_s=0.3).resume("proc-2")  # renewed: nothing to take
        answered.set()
        await sending

    with Slow() as receiver:
        asyncio.run(run(receiver.url))
    assert len(receiver.got) == 1 and store.get_job("job").webhook["state"] == "delivered"


def test_a_sender_that_died_before_its_first_attempt_leaves_the_body_it_was_given():
    clock = Clock()
    store = MemoryStore(clock)

    async def never(*args):
        await asyncio.Event().wait()

    async def run(url):
        job = finished_job(store, "job", url)
        dying = asyncio.ensure_future(sender(store, post=never, lease_s=30).deliver(job, payload(job), "proc-1"))
        await asyncio.to_thread(wait_until, lambda: store.get_delivery("job") is not None, HANG_S)
        dying.cancel()
        await asyncio.gather(dying, return_exceptions=True)
        clock.t += 31
        await sender(store, delays_s=QUICK).resume("proc-2")
        return job

    with Receiver() as receiver, contextlib.closing(store):
        job = asyncio.run(run(receiver.url))
    [(_, headers, body)] = receiver.got
    assert json.loads(body) == payload(job) and headers["webhook-id"] == "msg_job"
    after = store.get_job("job")
    assert after.meta == {} and after.webhook["state"] == "delivered"  # the body is the outbox's, not the job's


def test_a_process_that_died_between_the_jobs_end_and_its_delivery_leaves_it_parked():
    store = MemoryStore()

    async def describe(job):
        return {"type": f"video.{job.status}", "timestamp": "t", "data": {"id": job.id, "described": True}}

    async def run(url):
        job, _ = store.create_job(JobRecord("job", "video", {}, store.now(), owner="runner", lease_until=1e12,
                                            webhook={"url": url, "state": "pending", "attempts": 0}))
        park(store, job)  # when it was made
        hooks = sender(store, delays_s=QUICK, payload_of=describe)
        await hooks.resume("proc-2")
        assert receiver.got == []  # the job still runs: its parked delivery waits
        store.update_job("job", status=COMPLETED, completed_at=store.now())  # it ends; the process dies there
        await hooks.resume("proc-2")

    with Receiver() as receiver:
        asyncio.run(run(receiver.url))
    [(_, headers, body)] = receiver.got
    verify(SECRET, headers, body)
    assert json.loads(body)["data"] == {"id": "job", "described": True} and headers["webhook-id"] == "msg_job"
    assert store.get_job("job").webhook["state"] == "delivered" and store.get_delivery("job") is None
