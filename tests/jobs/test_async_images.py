"""Async image requests (`Prefer: respond-async`): a 202 with a job at once, before any step has run; the polled
result is byte for byte the synchronous answer's images for the same seed (generations and edits); the checks of
the synchronous request come before any job is made; `Idempotency-Key`; the webhook field; and a synchronous
request never touches the store."""

from __future__ import annotations

import io

import numpy as np
import pytest
from job_helpers import CountingStore, app_client, wait_job
from PIL import Image
from server.server_helpers import assert_error_shape
from step_gate import SteppedExecutor

from stepserve.engine.loading import load_executor
from stepserve.store.memory import MemoryStore

GENERATIONS, EDITS, JOBS = "/v1/images/generations", "/v1/images/edits", "/v1/images/jobs"
ASYNC = {"Prefer": "respond-async"}
BODY = {"prompt": "seven", "n": 2, "seed": 21, "num_inference_steps": 4, "guidance_scale": 3.0}


@pytest.fixture(scope="module")
def embedded():
    return load_executor("embedded")


def png(seed: int, size: int = 32) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_a_202_at_once_then_the_synchronous_answer(embedded):
    with app_client(embedded) as c:
        sync = c.post(GENERATIONS, json=BODY)  # the synchronous answer
    gate = SteppedExecutor(embedded)  # every step held until the test frees them: the 202 comes while none runs
    with app_client(gate) as c:
        created = c.post(GENERATIONS, json=BODY, headers=ASYNC)
        assert created.status_code == 202, created.text
        job = created.json()
        assert created.headers["location"] == f"{JOBS}/{job['id']}"
        assert job["id"].startswith("imgjob_") and job["object"] == "image.job" and job["result"] is None
        assert job["status"] == "queued" and job["progress"] == 0 and job["webhook"] is None
        assert gate.steps == 0  # no step of it has run
        gate.free()
        done = wait_job(c, f"{JOBS}/{job['id']}")
        listed = c.get(JOBS).json()["data"]
    assert (done["status"], done["progress"], done["error"]) == ("completed", 100, None), done
    assert sync.status_code == 200
    assert [d["b64_json"] for d in done["result"]["data"]] == [d["b64_json"] for d in sync.json()["data"]]
    assert set(done["result"]) == set(sync.json()) and done["result"]["size"] == sync.json()["size"]
    assert [i["seed"] for i in done["result"]["stepserve"]["images"]] == [21, 22]
    assert [j["id"] for j in listed] == [job["id"]] and "result" not in listed[0]


def test_an_async_edit_gives_the_synchronous_edit(embedded):
    files = {"image": ("in.png", png(1), "image/png")}
    fields = {"prompt": "seven", "seed": "5", "num_inference_steps": "6", "strength": "0.6"}
    with app_client(embedded) as c:
        sync = c.post(EDITS, files=files, data=fields)
        created = c.post(EDITS, files=files, data=fields, headers=ASYNC)
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        results = c.app.state.server.jobs.results
        assert results.read(f"{job_id}.image") == png(1)  # kept to run it again anywhere
        done = wait_job(c, f"{JOBS}/{job_id}")
        assert c.delete(f"{JOBS}/{job_id}").json() == {"id": job_id, "object": "image.job.deleted", "deleted": True}
        assert results.read(f"{job_id}.image") is None and results.read(f"{job_id}.1.json") is None
        assert c.get(f"{JOBS}/{job_id}").status_code == 404
    assert done["status"] == "completed", done
    assert done["result"]["data"][0]["b64_json"] == sync.json()["data"][0]["b64_json"]


def test_a_request_without_a_seed_gets_one_kept_with_the_job(embedded):
    with app_client(embedded) as c:
        job = c.post(GENERATIONS, json={"prompt": "one", "num_inference_steps": 2}, headers=ASYNC).json()
        stored = c.app.state.server.jobs.store.get_job(job["id"])
        done = wait_job(c, f"{JOBS}/{job['id']}")
    seed = stored.request["body"]["seed"]
    assert isinstance(seed, int) and done["result"]["stepserve"]["images"][0]["seed"] == seed


@pytest.mark.parametrize("body, headers, param, says", [
    ({"prompt": "a", "size": "40x40"}, ASYNC, "size", "is not supported"),
    ({"prompt": "a", "stream": True}, ASYNC, "stream", "not with 'Prefer: respond-async'"),
    ({"prompt": "a", "webhook": "ftp://example.com/x"}, ASYNC, "webhook", "http:// or https:// URL"),
    ({"prompt": "a", "webhook": "https://" + "a" * 2040 + ".com"}, ASYNC, "webhook", "at most 2048 characters"),
    ({"prompt": "a", "webhook": "https://"}, ASYNC, "webhook", "not a valid URL"),
    ({"prompt": "a", "webhook": "https://example.com/hook"}, {}, "webhook", "Prefer: respond-async"),
    ({"prompt": "a"}, {**ASYNC, "Idempotency-Key": "k" * 256}, "Idempotency-Key", "1 to 255 printable"),
    ({"prompt": "a"}, {**ASYNC, "Idempotency-Key": "café".encode()}, "Idempotency-Key", "printable ASCII"),
])
def test_bad_requests_are_400_and_make_no_job(embedded, body, headers, param, says):
    store = MemoryStore()
    with app_client(embedded, store=store, webhook_secret="s3cret") as c:
        error = assert_error_shape(c.post(GENERATIONS, json=body, headers=headers), 400)
    assert error["param"] == param and says in error["message"], error
    assert store.list_jobs() == []


def test_a_webhook_needs_a_server_with_a_webhook_secret(embedded):
    store = MemoryStore()
    with app_client(embedded, store=store) as c:
        answer = c.post(GENERATIONS, json={"prompt": "a", "webhook": "https://example.com/x"}, headers=ASYNC)
        video = c.post("/v1/videos", json={"prompt": "a", "webhook": "https://example.com/x"})
    error = assert_error_shape(answer, 400)
    assert error["param"] == "webhook" and "no webhook secret" in error["message"], error
    assert assert_error_shape(video, 400)["param"] == "model"  # the embedded model makes no videos: checked first
    assert store.list_jobs() == []


def test_an_idempotency_key_returns_the_same_job(embedded):
    store = MemoryStore()
    with app_client(embedded, store=store) as c:
        key = {**ASYNC, "Idempotency-Key": "order-17"}
        first = c.post(GENERATIONS, json=BODY, headers=key)
        again = c.post(GENERATIONS, json=BODY, headers=key)
        assert (first.status_code, again.status_code) == (202, 200)
        assert again.json()["id"] == first.json()["id"] and again.headers["location"] == first.headers["location"]
        other = c.post(GENERATIONS, json={**BODY, "prompt": "eight"}, headers=key)
        error = assert_error_shape(other, 409)
        assert error["code"] == "idempotency_key_reused" and first.json()["id"] in error["message"]
        assert len(store.list_jobs()) == 1
        wait_job(c, f"{JOBS}/{first.json()['id']}")
        c.delete(f"{JOBS}/{first.json()['id']}")  # the key lives as long as its job
        fresh = c.post(GENERATIONS, json=BODY, headers=key)
        assert fresh.status_code == 202 and fresh.json()["id"] != first.json()["id"]


def test_synchronous_requests_never_touch_the_store(embedded):
    """The cost item: with the store on, a plain image request (JSON answer, stream, edit) makes no store call."""
    store = CountingStore(MemoryStore())
    with app_client(embedded, store=store, poll_s=3600) as c:  # the runner polls once at start, then sleeps
        assert c.post(GENERATIONS, json={"prompt": "warm", "num_inference_steps": 2}).status_code == 200
        before = list(store.calls)
        assert c.post(GENERATIONS, json=BODY).status_code == 200
        with c.stream("POST", GENERATIONS, json={**BODY, "stream": True}) as r:
            assert "image_generation.completed" in r.read().decode()
        assert c.post(EDITS, files={"image": ("in.png", png(2), "image/png")},
                      data={"prompt": "a", "num_inference_steps": "2"}).status_code == 200
        after = list(store.calls)
        assert c.post(GENERATIONS, json=BODY, headers=ASYNC).status_code == 202  # an async one does
        assert len(store.calls) > len(after)
    assert after == before, after[len(before):]


def test_a_store_that_cannot_be_written_is_a_503_and_the_server_serves_on(embedded):
    class Broken(MemoryStore):
        def create_job(self, job):
            raise ConnectionError("the store went away")

    with app_client(embedded, store=Broken()) as c:
        refused = c.post(GENERATIONS, json={"prompt": "a", "num_inference_steps": 2}, headers=ASYNC)
        served = c.post(GENERATIONS, json={"prompt": "a", "num_inference_steps": 2})
    error = assert_error_shape(refused, 503)
    assert error["code"] == "state_unavailable" and refused.headers["retry-after"] == "1", error
    assert served.status_code == 200


def test_a_server_of_another_model_on_the_same_state_never_sees_nor_claims_the_job(embedded, tiny_sd_path):
    """Two servers of different models sharing one state are two services (by default): a job made for the one
    is never claimed by the other (not even to hand it back: the claim filters in the store), nor read, listed or
    deleted through it (404)."""
    from server.server_helpers import wait_until

    store = MemoryStore()
    with app_client(embedded, store=store, owner="a") as a, \
            app_client(load_executor(str(tiny_sd_path)), store=store, owner="b") as b:
        a_jobs, b_jobs = a.app.state.server.jobs, b.app.state.server.jobs
        assert a_jobs.service != b_jobs.service and a_jobs.service.startswith("embedded-")
        a_jobs.runner.claiming = False  # b sees the job first
        job = a.post(GENERATIONS, json={"prompt": "one", "num_inference_steps": 2}, headers=ASYNC).json()
        rounds = b_jobs.runner.rounds
        b_jobs.runner.wake()
        assert wait_until(lambda: b_jobs.runner.rounds >= rounds + 2, 240)  # b has looked for jobs since
        assert store.get_job(job["id"]).attempts == 0  # never claimed
        assert b.get(f"{JOBS}/{job['id']}").status_code == 404 and b.get(JOBS).json()["data"] == []
        assert b.delete(f"{JOBS}/{job['id']}").status_code == 404 and store.get_job(job["id"]) is not None
        a_jobs.runner.claiming = True
        a_jobs.runner.wake()
        done = wait_job(a, f"{JOBS}/{job['id']}")
    assert done["status"] == "completed" and done["result"]["stepserve"]["model"] == "embedded", done
    assert store.get_job(job["id"]).attempts == 1


def test_a_creation_cancelled_while_its_job_is_stored_keeps_the_jobs_inputs(embedded, monkeypatch):
    """The handler is cancelled (its client gone, Ray Serve) while the store's thread makes the job: the job exists,
    so its pictures must stay (they were deleted, and the job then failed input_missing)."""
    import asyncio

    from stepserve.server import image_jobs

    made = []

    async def stored_then_cancelled(state, job, *args):
        made.append(await create_job(state, job, *args))
        raise asyncio.CancelledError  # the cancellation arrives as the insert completes

    create_job = image_jobs.create_job
    monkeypatch.setattr(image_jobs, "create_job", stored_then_cancelled)
    files = {"image": ("in.png", png(1), "image/png")}
    with app_client(embedded) as c:
        c.app.state.server.jobs.runner.claiming = False
        with pytest.raises(BaseException):  # noqa: B017 - the cancellation reaches the test client
            c.post(EDITS, files=files, data={"prompt": "seven", "seed": "5", "num_inference_steps": "2"},
                   headers=ASYNC)
        (job, created), = made
        assert created and c.app.state.server.jobs.results.read(f"{job.id}.image") == png(1)
        monkeypatch.undo()
        c.app.state.server.jobs.runner.claiming = True
        c.app.state.server.jobs.runner.wake()
        done = wait_job(c, f"{JOBS}/{job.id}")
    assert done["status"] == "completed", done
