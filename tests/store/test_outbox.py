"""The webhook outbox (stepserve/store/base.py, create_delivery ... end_delivery), every backend: a job has one
delivery; a claim takes only a delivery whose lease has passed, and two claimers racing for it get it once; renewing
and ending are fenced by the owner; the body stored at creation is what every later reader gets."""

from __future__ import annotations

import itertools
import threading

import pytest
from redis_server import redis_url  # noqa: F401  (a fixture)
from store_backends import open_backend
from test_contract import Backend

from stepserve.store.base import DeliveryRecord

_prefixes = itertools.count()


@pytest.fixture(params=("memory", "sqlite", "redis"))
def backend(request, tmp_path):
    from store_backends import Clock

    name, location, prefix, clock = request.param, "", "", None
    if name == "sqlite":
        location, clock = str(tmp_path / "state.db"), Clock()
    elif name == "memory":
        clock = Clock()
    else:
        location, prefix = request.getfixturevalue("redis_url"), f"outbox{next(_prefixes)}:"
    store = open_backend(name, location, prefix, clock)
    yield Backend(name, store, location, prefix, clock)
    store.close()


def delivery(store, job_id="job", owner="proc-1", lease_s=0.5, body='{"type":"image.completed","n":1.25}'):
    now = store.now()
    return DeliveryRecord(job_id, "https://hooks.example/x", body, now, owner, now + lease_s)


def test_one_delivery_per_job_kept_as_created(backend):
    store = backend.store
    first = delivery(store)
    assert store.create_delivery(first) is True
    assert store.create_delivery(delivery(store, owner="proc-2", body="{}")) is False  # the same end, notified twice
    got = store.get_delivery("job")
    assert (got.url, got.body, got.owner, got.attempts) == (first.url, first.body, "proc-1", 0)
    assert got.created_at == pytest.approx(first.created_at) and got.lease_until == pytest.approx(first.lease_until)
    assert store.get_delivery("other") is None


def test_a_claim_takes_only_a_delivery_whose_lease_has_passed_and_fences_its_owner(backend):
    store = backend.store
    # a lease a stall on a busy machine does not outlast between two calls (Redis's clock is real time)
    held = delivery(store, lease_s=3.0)
    store.create_delivery(held)
    assert store.claim_delivery("proc-2", 30) is None and store.claim_delivery("proc-2", 30, "job") is None
    assert store.renew_delivery("job", "proc-1", 3.0, attempts=1).attempts == 1  # its sender renews it
    backend.pass_time(store.get_delivery("job").lease_until)  # then dies: the lease passes
    taken = store.claim_delivery("proc-2", 30)
    assert (taken.job_id, taken.owner, taken.attempts, taken.body) == ("job", "proc-2", 1, held.body)
    assert store.claim_delivery("proc-3", 30) is None  # held again, by the new owner
    assert store.renew_delivery("job", "proc-1", 30) is None  # the old owner finds out and stops
    assert store.end_delivery("job", "proc-1") is False
    assert store.end_delivery("job", "proc-2") is True and store.get_delivery("job") is None
    assert store.end_delivery("job") is False and store.claim_delivery("proc-2", 30) is None


def test_two_claimers_racing_get_a_delivery_once(backend):
    store = backend.store
    for i in range(6):
        store.create_delivery(delivery(store, f"job{i}", owner=None, lease_s=-1))
    got: list[str] = []
    barrier = threading.Barrier(2)

    def claim(owner):
        barrier.wait(timeout=60)
        while (d := store.claim_delivery(owner, 600)) is not None:
            got.append(d.job_id)

    threads = [threading.Thread(target=claim, args=(f"proc-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [f"job{i}" for i in range(6)]  # each once


def test_a_parked_delivery_waits_for_its_job_and_takes_the_body_when_it_ends(backend):
    from stepserve.store.base import JobRecord

    store = backend.store
    store.create_job(JobRecord("job", "image", {}, store.now()))
    store.create_job(JobRecord("other", "image", {}, store.now()))
    parked = DeliveryRecord("job", "https://hooks.example/x", "", store.now())  # made with the job
    assert store.create_delivery(parked) is True
    store.create_delivery(DeliveryRecord("other", "https://hooks.example/y", "", store.now()))
    assert store.claim_delivery("proc-2", 30) is None and store.claim_delivery("proc-2", 30, "job") is None
    store.update_job("job", status="completed", completed_at=store.now())
    ended = delivery(store, owner="proc-1", lease_s=30)
    assert store.create_delivery(ended) is True  # the runner that ended it fills it in
    assert store.get_delivery("job").body == ended.body and store.create_delivery(ended) is False
    assert store.claim_delivery("proc-2", 30) is None  # held by its sender; "other" still runs
    store.delete_job("other")  # gone: its parked delivery is taken (and ended by whoever takes it)
    taken = store.claim_delivery("proc-2", 30)
    assert (taken.job_id, taken.body) == ("other", "")
    assert store.create_delivery(DeliveryRecord("other", "u", "{}", store.now(), "proc-3", store.now() + 30)) is False
    assert store.renew_delivery("other", "proc-2", 30, body='{"x":1}').body == '{"x":1}'


def test_a_claim_for_a_service_takes_only_that_services_deliveries(backend):
    """A server takes up only its own service's deliveries: another service's would be signed with its secret."""
    store = backend.store
    for job_id, service in (("theirs", "svc-b"), ("ours", "svc-a")):
        d = delivery(store, job_id, owner=None, lease_s=-1)
        d.service = service
        store.create_delivery(d)
    assert store.claim_delivery("a-1", 30, "theirs", "svc-a") is None
    taken = store.claim_delivery("a-1", 30, None, "svc-a")
    assert (taken.job_id, taken.service) == ("ours", "svc-a")
    assert store.claim_delivery("a-1", 30, None, "svc-a") is None  # theirs is left for a server of svc-b
    assert store.claim_delivery("b-1", 30, None, "svc-b").job_id == "theirs"


def test_a_delivery_made_before_services_is_taken_up_by_any(backend):
    """Deliveries of a state written before services (service "") are not left forever: any server takes them."""
    store = backend.store
    store.create_delivery(delivery(store, "old", owner=None, lease_s=-1))
    assert store.claim_delivery("a-1", 30, None, "svc-a").job_id == "old"
