"""Several models behind Ray Serve replicas: every replica serves every model; the router sends a request that
names its model (Ray's `serve_multiplexed_model_id` header) to a replica holding it on its device, else in host
memory (the fakes below), and a local Ray cluster serves two tiny models on two replicas (slow)."""

from __future__ import annotations

import pytest
from test_ray_router import FakeReplica, choose, make_router, published


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


def test_a_model_just_sent_to_a_replica_counts_as_there_until_newer_stats():
    """Without the note the second request of a model no replica holds goes to the other idle replica (least work
    counts the first as sent to b) and loads it there too."""
    router = make_router(router="least_work")
    a = FakeReplica("a", with_models(published(0.0, 0, 1.0), sd="disk"))
    b = FakeReplica("b", with_models(published(0.0, 0, 1.0), sd="disk"))
    first = choose(router, [a, b], "r1", multiplexed_model_id="sd")[0][0]
    router.on_send_request(first)
    assert choose(router, [a, b], "r2", multiplexed_model_id="sd")[0][0] == first
    other = "b" if first == "a" else "a"
    replica = {"a": a, "b": b}
    replica[first].routing_stats = with_models(published(0.0, 0, 1e12), sd="host")  # taken later: moved off since
    replica[other].routing_stats = with_models(published(0.0, 0, 1e12), sd="device")
    assert choose(router, [a, b], "r3", multiplexed_model_id="sd")[0][0] == other


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
