"""Two services on one state (a SQLite file, a Redis): neither sees, lists, claims nor deletes the other's jobs,
and each one's jobs run while the other is down. Adapter registrations are scoped the same way. And the default
service differs for servers of different models, and is the same for replicas of one."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from job_helpers import app_client, wait_job
from store.redis_server import redis_url  # noqa: F401  (a fixture)

from stepserve.engine.loading import load_executor
from stepserve.server.jobs_app import default_service
from stepserve.server.lora_registry import AdapterRegistry
from stepserve.store import open_store
from stepserve.store.memory import MemoryStore
from stepserve.store.results import Results

GENERATIONS, JOBS = "/v1/images/generations", "/v1/images/jobs"
ASYNC = {"Prefer": "respond-async"}
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def embedded():
    return load_executor("embedded")


@pytest.fixture(params=["sqlite", "redis"])
def open_state(request, tmp_path):
    """Opens the shared state (each server its own connection, as processes do)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'state.db'}"
        return lambda: open_store(url)
    from stepserve.store.redis import RedisStore

    url, prefix = request.getfixturevalue("redis_url"), f"services{next(_prefixes)}:"
    return lambda: RedisStore(url, prefix=prefix)


def test_two_services_on_one_state_keep_to_their_own_jobs_and_run_while_the_other_is_down(embedded, open_state,
                                                                                        tmp_path):
    results = Results(tmp_path / "results", keep_s=3600)
    body = {"prompt": "x", "seed": 1, "num_inference_steps": 2}
    with app_client(embedded, store=open_state(), results=results, owner="x", service="x") as x:
        x.app.state.server.jobs.runner.claiming = False  # x goes down before it runs its job
        x_job = x.post(GENERATIONS, json=body, headers=ASYNC).json()
        x_key_job = x.post(GENERATIONS, json=body, headers={**ASYNC, "Idempotency-Key": "k1"}).json()
    peek = open_state()
    with app_client(embedded, store=open_state(), results=results, owner="y", service="y") as y:  # x is down
        y_job = y.post(GENERATIONS, json={**body, "prompt": "y"}, headers=ASYNC).json()
        y_done = wait_job(y, f"{JOBS}/{y_job['id']}")
        assert y.get(f"{JOBS}/{x_job['id']}").status_code == 404
        assert [j["id"] for j in y.get(JOBS).json()["data"]] == [y_job["id"]]
        assert y.delete(f"{JOBS}/{x_job['id']}").status_code == 404
        assert y.delete(f"{JOBS}/{x_key_job['id']}").status_code == 404
        # the same body under x's Idempotency-Key: a job of y's own, not x's (nor a 409 naming it)
        keyed = {**ASYNC, "Idempotency-Key": "k1"}
        assert x_key_job["id"] != (mine := y.post(GENERATIONS, json=body, headers=keyed)).json()["id"], mine.text
        assert mine.status_code == 202
        assert y.post(GENERATIONS, json=body, headers=keyed).json()["id"] == mine.json()["id"]  # y's key works
        wait_job(y, f"{JOBS}/{mine.json()['id']}")
    assert y_done["status"] == "completed", y_done
    held = peek.get_job(x_job["id"])
    assert (held.status, held.attempts, held.service) == ("queued", 0, "x")  # y never claimed it
    with app_client(embedded, store=open_state(), results=results, owner="x", service="x") as x:  # y is down
        x_done = wait_job(x, f"{JOBS}/{x_job['id']}")
        assert x.get(f"{JOBS}/{y_job['id']}").status_code == 404
        assert {j["id"] for j in x.get(JOBS).json()["data"]} == {x_job["id"], x_key_job["id"]}
    assert x_done["status"] == "completed", x_done
    assert peek.get_job(y_job["id"]).status == "completed"  # still there: nothing of x touched it
    peek.close()


def test_a_delete_of_a_registration_touches_only_its_service():
    store = MemoryStore()
    x, y = (AdapterRegistry(None, store, "replica-" + s, service=s) for s in ("x", "y"))

    async def scenario():
        await x.register("style", "x/style.safetensors")
        await y.register("style", "y/style.safetensors")
        assert (await y.registration("style")).path == "y/style.safetensors"
        assert await y.unregister("style") is not None
        assert await y.unregister("style") is None and await y.registration("style") is None
        return await x.registration("style")

    kept = asyncio.run(scenario())
    assert kept is not None and kept.path == "x/style.safetensors" and kept.deleted_at is None


def test_the_default_service_is_the_models_and_what_it_serves(embedded, tiny_sd_path):
    from dataclasses import replace

    info = embedded.model_info
    assert default_service(info) == default_service(load_executor("embedded").model_info)  # replicas share it
    assert default_service(info) != default_service(load_executor(str(tiny_sd_path)).model_info)
    assert default_service(info) != default_service(replace(info, max_size=info.max_size * 2))
    assert default_service(info) == default_service(replace(info, lora_names=frozenset({"style"})))
    # a ControlNet or IP-Adapter copied into its folder between two replicas' starts: still one service
    some = replace(info, control_names=frozenset({"pose"}), ip_adapter_names=frozenset({"face"}))
    more = replace(info, control_names=frozenset({"pose", "edges"}), control_guess_only=frozenset({"edges"}),
                   ip_adapter_names=frozenset({"face", "style"}))
    assert default_service(some) == default_service(more)
    # whether it serves them at all is part of it: a server without ControlNets never takes a job naming one
    assert default_service(replace(info, controls=True)) != default_service(
        replace(info, controls=True, control_names=frozenset({"edges"})))
    assert default_service(replace(info, ip_adapters=True)) != default_service(
        replace(info, ip_adapters=True, ip_adapter_names=frozenset({"face"})))
    assert default_service(info).startswith(f"{info.name}-{info.family}-")


def test_the_sweep_forgets_registrations_deleted_longer_ago_than_results_are_kept(tmp_path):
    from stepserve.jobs.sweep import sweep_once
    from stepserve.store import AdapterRecord

    now = [1000.0]
    store, results = MemoryStore(lambda: now[0]), Results(tmp_path, keep_s=60)
    for name in ("kept", "deleted", "deleted-late"):
        store.register_adapter(AdapterRecord(name, f"{name}.safetensors", now[0], service="x"))
    store.delete_adapter("deleted", "x")
    now[0] += 30
    store.delete_adapter("deleted-late", "x")
    now[0] += 31  # 61 s after the first deletion, 31 s after the second
    sweep_once(store, results)
    assert [(r.name, r.deleted_at is None) for r in store.adapters()] == [("deleted-late", False), ("kept", True)]
