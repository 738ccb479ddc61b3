"""Several models behind Ray Serve replicas: every replica serves every model; the router sends a request that
names its model (Ray's `serve_multiplexed_model_id` header) to a replica holding it on its device, else in host
memory (the fakes below), and a local Ray cluster serves two tiny models on two replicas (slow)."""

from __future__ import annotations

import pytest
from extras import require
from test_ray_router import FakeReplica, choose, make_router, published

from stepserve.commands.serve import main as serve_main


def with_models(stats: dict, **places: str) -> dict:
    return {**stats, "models": places}


def test_a_request_naming_its_model_goes_where_the_model_is_on_the_device():
    router = make_router(router="least_work")
    a = FakeReplica("a", with_models(published(3.0, 2, 1.0), sd="device", flux="host"))
    b = FakeReplica("b", with_models(published(0.0, 0, 1.0), sd="host", flux="device"))
    c = FakeReplica("c", with_models(published(0.0, 0, 1.0), sd="disk", flux="disk"))
    assert choose(router, [a, b, c], "r1", multiplexed_model_id="sd")[0] == ["a", "b", "c"]  # busier, but holds it
    assert choose(router, [a, b, c], "r2", multiplexed_model_id="flux")[0][0] == "b"
    assert choose(router, [a, b, c], "r3")[0][0] == "b"  # no header: the least work, ties to the lowest index
    a.routing_stats = with_models(published(3.0, 2, 2.0), sd="disk", flux="disk")
    assert choose(router, [a, b, c], "r4", multiplexed_model_id="sd")[0][0] == "b"  # in host memory: moved, not loaded


def test_a_model_just_sent_to_a_replica_counts_as_there_until_stats_taken_after_it_came_back():
    """Without the note the second request of a model no replica holds goes to the other idle replica (least work
    counts the first as sent to b) and loads it there too."""
    router = make_router(router="least_work")
    a = FakeReplica("a", with_models(published(0.0, 0, 1.0), sd="disk", xl="disk"))
    b = FakeReplica("b", with_models(published(0.0, 0, 1.0), sd="disk", xl="disk"))
    first = choose(router, [a, b], "r1", multiplexed_model_id="sd")[0][0]
    router.on_send_request(first)
    other = "b" if first == "a" else "a"
    assert choose(router, [a, b], "r2", multiplexed_model_id="sd")[0][0] == first
    assert choose(router, [a, b], "r3", multiplexed_model_id="xl")[0][0] == other  # fewer models on its device
    replica = {"a": a, "b": b}
    replica[first].routing_stats = with_models(published(0.0, 0, 1e12), sd="disk", xl="disk")  # before it arrived
    assert choose(router, [a, b], "r4", multiplexed_model_id="sd")[0][0] == first  # still out there: still there
    router.on_request_completed(first, "r1")
    replica[first].routing_stats = with_models(published(0.0, 0, 1e12), sd="host", xl="device")  # taken later
    replica[other].routing_stats = with_models(published(0.0, 0, 1e12), sd="device", xl="disk")
    assert choose(router, [a, b], "r5", multiplexed_model_id="sd")[0][0] == other


def test_a_header_naming_no_model_is_an_adapter_and_polls_bring_no_model():
    router = make_router(router="least_work", adapter_load_s=5.0)
    a = FakeReplica("a", with_models(published(2.0, 1, 1.0, adapters=("ink",)), sd="disk"))
    b = FakeReplica("b", with_models(published(0.0, 0, 1.0), sd="device"))
    assert choose(router, [a, b], "r1", multiplexed_model_id="ink")[0][0] == "a"  # adapter affinity, as before
    assert choose(router, [a, b], "r2", multiplexed_model_id="sd", route="/v1/images/jobs/{job_id}")[0][0] == "b"
    router.on_send_request("a")  # a poll sent to a: no model brought there
    assert router.places_of(a) == {"sd": "disk"}


def test_round_robin_turns_within_the_replicas_holding_the_model():
    router = make_router(router="round_robin")
    replicas = [FakeReplica(n, with_models(published(0.0, 0, 1.0), sd=p)) for n, p in
                (("a", "device"), ("b", "disk"), ("c", "device"))]
    picks = [choose(router, replicas, f"r{i}", multiplexed_model_id="sd")[0][0] for i in range(4)]
    assert picks == ["a", "c", "a", "c"]


def test_several_models_with_replicas_deploy_every_model_to_every_replica(monkeypatch):
    """`serve --model a=... --model b=... --replicas 2` is no longer refused: serve's replica path gets the models
    (plain data each replica builds its own from), the default model's flags for the rest."""
    seen = {}

    def on_replicas(args, models=None):
        seen.update(args=args, models=models)
        return 0

    monkeypatch.setattr("stepserve.commands.serve.serve_on_replicas", on_replicas)
    assert serve_main(["--model", "a=embedded", "--model", "b=embedded", "--replicas", "2", "--default-model", "b",
                       "--device-memory-mb", "6", "--served-model-name", "dall-e-2"]) == 0
    models = seen["models"]
    assert [s.name for s in models.specs] == ["a", "b"] and models.default == "b"
    assert models.device_bytes == 6 * 2**20 and models.host_bytes is None
    assert models.specs[1].aliases == ("dall-e-2",) and seen["args"].model == "embedded"
    threaded = models.with_engines(threads=3)  # what each replica does with its own share
    assert [s.config.threads for s in threaded.specs] == [3, 3]


def test_a_replica_publishes_where_each_name_is_and_reports_the_models_on_its_device_when_they_change(monkeypatch):
    """Its routing stats carry every served name's place (aliases too); the names on its device go to Ray Serve's
    controller as its multiplexed model ids (for Ray's own router) once per change."""
    require("ray", "ray")
    from types import SimpleNamespace

    from stepserve.engine.device import SharedDevice
    from stepserve.server.models import ModelSet, ModelSpec
    from stepserve.server.ray.replica_models import ReplicaModels

    specs = [ModelSpec("sd", SimpleNamespace(model="embedded"), aliases=("dall-e-2",)),
             ModelSpec("xl", SimpleNamespace(model="embedded"), eager=False)]
    replica = ReplicaModels.__new__(ReplicaModels)  # its models without engines: nothing loaded yet
    replica.models, replica.pushed = ModelSet(specs, "sd", SharedDevice(), make_app=None), None
    pushed = []
    client = SimpleNamespace(record_request_routing_info=lambda info: pushed.append(info.multiplexed_model_ids))
    monkeypatch.setattr("ray.serve.context._get_global_client", lambda: client)

    stats = replica.routing_stats()
    assert stats["models"] == {"sd": "disk", "dall-e-2": "disk", "xl": "disk"} and stats["outstanding"] == 0
    replica.push_model_ids("replica-id")
    replica.push_model_ids("replica-id")
    assert pushed == [[]]  # once: nothing changed in between
    replica.models.device.add("sd", 1, lambda where: None, lambda: False)
    replica.models.entries["sd"].stack = object()  # running
    assert replica.routing_stats()["models"] == {"sd": "device", "dall-e-2": "device", "xl": "disk"}
    replica.push_model_ids("replica-id")
    assert pushed == [[], ["dall-e-2", "sd"]]


MODELS_TOML = """
[models.a]
path = "embedded"
load = "first-use"
[models.b]
path = "embedded"
load = "first-use"
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_replicas_serve_two_models_and_the_header_keeps_each_model_on_its_replica(tmp_path):
    """Two tiny models on two replicas, device memory for one model at a time, --router least_work: requests of
    both are answered, with and without the header. With the header, a's requests stay on the replica that loaded
    a and b's go to the other (no model on its device) and stay there; without model affinity every one of these
    requests, sent one at a time to idle replicas, would go to the same replica and move the models in turns."""
    import uuid

    import httpx
    from ray_cluster import Cluster, ServeProcess
    from server_helpers import GENERATIONS

    require("ray", "ray")
    (tmp_path / "models.toml").write_text(MODELS_TOML)
    cluster = Cluster(uuid.uuid4().hex)
    server = None
    try:
        server = ServeProcess(cluster.mark, "--models", str(tmp_path / "models.toml"), "--device-memory-mb", "6",
                              "--replicas", "2", "--ray-address", cluster.address, "--router", "least_work",
                              "--shutdown-grace-s", "2", model=None)
        server.wait_ready()

        def generate(model: str, header: bool = True, seed: int = 1) -> httpx.Response:
            body = {"model": model, "prompt": f"digit {seed}", "seed": seed, "num_inference_steps": 2}
            headers = {"serve_multiplexed_model_id": model} if header else {}
            with httpx.Client(timeout=300) as client:  # a fresh connection each: Ray's proxy routes each request
                r = client.post(server.url + GENERATIONS, json=body, headers=headers)
            assert r.status_code == 200, (r.status_code, r.text[:300], server.tail())
            return r

        served = {"a": [], "b": []}
        for i in range(4):
            for model in ("a", "b"):
                served[model].append(generate(model, seed=i).headers["X-Stepserve-Replica"])
        assert len(set(served["a"])) == 1 and len(set(served["b"])) == 1, served
        assert served["a"][0] != served["b"][0], served
        for model in ("a", "b"):  # no header: still served, by whichever replica (each serves every model)
            generate(model, header=False)
        with httpx.Client(timeout=60) as client:
            missing = client.post(server.url + GENERATIONS, json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", missing.text
    finally:
        if server is not None:
            assert server.stop() == 0, server.tail()
            server.log.close()
        cluster.close()
