"""The fleet's router and autoscaling policy inside Ray Serve, without a cluster: the RequestRouter subclass ranks
replicas by their published stats plus what it sent since, the SLO policy reads the replicas' work in hand, and
the serve flags map onto Ray Serve's options (the loopback runs are in test_ray_serve.py and the benchmarks)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from extras import require

from stepserve.commands.serve import main as serve_main
from stepserve.fleet.stats import ReplicaStats


@dataclass
class FakeReplica:
    """What FleetRouter reads of Ray Serve's RunningReplica."""

    replica_id: str
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 16


@dataclass
class FakeMeta:
    internal_request_id: str
    route: str = "/v1/images/generations"
    multiplexed_model_id: str = ""


class Assigned:
    """What Ray's pending request's future holds once a replica is assigned to it."""

    def __init__(self) -> None:
        self.replica = None

    def done(self) -> bool:
        return self.replica is not None

    def cancelled(self) -> bool:
        return False

    def exception(self):
        return None

    def result(self):
        return self.replica


@dataclass
class FakePending:
    metadata: FakeMeta
    future: Assigned = field(default_factory=Assigned)


def published(work_s: float, n: int, taken_at: float, adapters=()) -> dict:
    d = ReplicaStats(outstanding=n, work_s=work_s, curve=(0.1,), adapters=frozenset(adapters)).to_dict()
    d.update(taken_at=taken_at, default_steps=20)
    return d


def make_router(**kwargs):
    require("ray", "ray")
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from stepserve.server.ray.router import FleetRouter

    router = FleetRouter(DeploymentID(name="Engine", app_name="stepserve"), DeploymentHandleSource.PROXY)
    router.initialize_state(**kwargs)
    return router


def choose(router, replicas, rid, **meta):
    pending = FakePending(FakeMeta(rid, **meta))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    pending.future.replica = ranks[0][0]  # Ray sends it to the first with room (none is full here)
    return [r[0].replica_id for r in ranks], pending


def burst(router, replicas, n: int) -> list[str]:
    """n requests ranked and sent one after another, before any new stats: where each went."""
    sent = []
    for i in range(n):
        first = choose(router, replicas, f"r{i}")[0][0]
        router.on_send_request(first)
        sent.append(first)
    return sent


def test_the_router_ranks_by_predicted_finish_and_counts_what_it_sent_since():
    """Driven as Ray Serve drives it: choose_replicas, then on_send_request for the replica it sent to (Ray calls
    on_request_routed only when replicas may refuse, which stepserve's do not), on_request_completed at the end."""
    router = make_router(router="least_work")
    a, b = FakeReplica("a", published(4.0, 1, 100.0)), FakeReplica("b", published(1.0, 3, 100.0))
    assert choose(router, [a, b], "r1")[0] == ["b", "a"]  # less work in hand, though it holds more requests
    router.on_send_request("b")  # 20 steps x 0.1 s at its quote
    assert choose(router, [a, b], "r2")[0] == ["b", "a"]  # 1 + 2 s: still sooner than a's 4 s
    router.on_send_request("b")
    assert router.sent.pending("b") == (2, 4.0)
    assert choose(router, [a, b], "r3")[0] == ["a", "b"]  # b now holds its 1 s and the 4 s just sent
    router.on_request_completed("b", "whichever")  # one came back: one note goes
    assert router.sent.pending("b") == (1, 2.0)
    b.routing_stats = published(3.0, 4, 1e12)  # stats taken after the sends: they are in them now
    assert choose(router, [a, b], "r4")[0] == ["b", "a"] and router.sent.pending("b") == (0, 0.0)
    router.on_request_completed("a", "r-unknown")  # nothing noted: nothing to drop


def test_requests_out_there_count_though_newer_stats_do_not_hold_them_yet():
    """A request sent to b and not answered that b's engine does not hold yet (stats taken after the send show b
    empty): it still counts, so the next request goes to a. Without the floor b looks idle and draws it too."""
    router = make_router(router="least_work")
    a, b = FakeReplica("a", published(1.0, 1, 1.0)), FakeReplica("b", published(0.0, 0, 1.0))
    assert choose(router, [a, b], "r1")[0][0] == "b"  # a: 1 s before its 2 s; b: at once
    router.on_send_request("b")  # priced 20 steps x 0.1 s = 2 s there
    b.routing_stats = published(0.0, 0, 1e12)  # taken after the send; the request is not in b's engine yet
    assert choose(router, [a, b], "r2")[0] == ["a", "b"]  # b: 2 s out there before its own 2 s; a: 1 s before
    assert router.sent.pending("b") == (0, 0.0)  # the note went with the newer stats: the floor is what counted
    router.on_request_completed("b", "r1")
    assert choose(router, [a, b], "r3")[0] == ["b", "a"]  # back: b is idle again


def test_a_burst_before_any_new_stats_alternates_between_equal_replicas():
    router = make_router(router="least_work")
    sent = burst(router, [FakeReplica("a", published(0.0, 0, 1.0)), FakeReplica("b", published(0.0, 0, 1.0))], 6)
    assert sent.count("a") == sent.count("b") == 3


def test_a_request_naming_a_held_adapter_goes_where_it_is_held():
    router = make_router(router="least_work", adapter_load_s=5.0)
    a = FakeReplica("a", published(2.0, 1, 1.0, adapters=("ink",)))
    b = FakeReplica("b", published(0.0, 0, 1.0))
    assert choose(router, [a, b], "r1", multiplexed_model_id="ink")[0][0] == "a"
    assert choose(router, [a, b], "r2")[0][0] == "b"
    assert choose(router, [a, b], "r3", route="/health")[0][0] == "b"  # no work: the least loaded all the same


@pytest.mark.parametrize("route,method,priced", [
    ("/v1/images/generations", "", True), ("/v1/images/edits", "", True), ("/v1/videos", "", True),
    ("/v1/videos", "POST", True), ("/v1/videos", "GET", False),  # the listing, where Ray gives the method
    ("", "", True), ("/", "", True),  # unknown: priced, the safe side
    ("/v1/videos/{video_id}", "", False), ("/v1/videos/{video_id}/events", "", False),
    ("/v1/videos/{video_id}/content", "", False), ("/v1/images/jobs/{job_id}", "", False),
    ("/v1/images/jobs/{job_id}/events", "", False), ("/v1/images/jobs", "", False), ("/v1/loras", "", False),
    ("/v1/models", "", False), ("/health", "", False),
])
def test_only_requests_that_generate_are_priced(route, method, priced):
    """A job's polls and event streams are not generations: priced at nothing, so a replica polled often does
    not look busy."""
    router = make_router(router="least_work")
    meta = FakeMeta("r", route=route)
    meta._http_method = method
    assert router.job(FakePending(meta)).steps == (20 if priced else 0)


def test_a_replica_that_published_nothing_yet_counts_as_idle():
    router = make_router(router="least_work")
    assert choose(router, [FakeReplica("a", published(3.0, 2, 1.0)), FakeReplica("new")], "r")[0] == ["new", "a"]


@dataclass
class FakeContext:
    running_replicas: list
    target_num_replicas: int
    raw_metrics: dict
    policy_state: dict = field(default_factory=dict)
    current_time: float = 0.0


@dataclass
class Point:
    timestamp: float
    value: float


def test_the_slo_autoscaling_policy_reads_the_latest_work_and_keeps_replicas_running_jobs():
    require("ray", "ray")
    from stepserve.server.ray.fleet import SLOAutoscaling

    policy = SLOAutoscaling(slo_s=2.0, low=1, high=4)
    work = {"r1": [Point(1.0, 0.1), Point(2.0, 3.0)], "r2": [Point(2.0, 3.0)]}  # the latest: 3 s each
    want, state = policy(FakeContext(["r1", "r2"], 2, {"work_s": work}))
    assert want == 4  # 6 s of work: a request waits 3 s on two replicas, the SLO allows 1 s of waiting
    idle = {"work_s": {"r1": [Point(9.0, 0.0)], "r2": [Point(9.0, 0.0)]}}
    jobs = dict(idle, jobs={"r1": [Point(9.0, 1.0)]})
    state = {"low_since": -1000.0}  # low for long enough to come down
    assert policy(FakeContext(["r1", "r2"], 2, jobs, dict(state), 9.0))[0] == 2  # r1 runs a video: none stops
    assert policy(FakeContext(["r1", "r2"], 2, idle, dict(state), 9.0))[0] == 1


def test_router_and_slo_flags_map_onto_ray_serve_options():
    require("ray", "ray")
    from stepserve.commands.serve import build_parser
    from stepserve.server.ray.options import deployment_options, plan_replicas
    from stepserve.server.ray.router import ROUTER_CLASS

    def options(*flags):
        return deployment_options(plan_replicas(build_parser().parse_args(list(flags)), local_cores=4))

    assert "request_router_config" not in options("--replicas", "2")  # the default with 2: Ray's own power of two
    for three in (("--replicas", "3"), ("--replicas", "1", "--autoscale", "1:3")):  # from 3 up: least_work
        assert options(*three)["request_router_config"]["request_router_kwargs"]["router"] == "least_work"
    config = options("--replicas", "2", "--router", "least_work")["request_router_config"]
    assert config["request_router_class"] == ROUTER_CLASS and config["request_router_kwargs"]["router"] == "least_work"
    assert config["request_routing_stats_period_s"] <= 1.0
    assert "request_router_config" not in options("--replicas", "2", "--router", "power_of_two")  # Ray's own
    sampled = options("--replicas", "2", "--router", "least_work_sampled", "--adapter-load-s", "3")
    assert sampled["request_router_config"]["request_router_kwargs"] == {"router": "least_work_sampled",
                                                                         "adapter_load_s": 3.0}
    scaled = options("--replicas", "1", "--autoscale", "1:2", "--slo-p95-ms", "800")["autoscaling_config"]
    assert scaled["policy"]["policy_function"] == "stepserve.server.ray.fleet:SLOAutoscaling"
    assert scaled["policy"]["policy_kwargs"] == {"slo_s": 0.8, "low": 1, "high": 2}
    assert scaled["upscale_delay_s"] == 0.0 and scaled["downscale_delay_s"] == 0.0  # the policy's own delays
    assert "policy" not in options("--replicas", "1", "--autoscale", "1:2")["autoscaling_config"]  # Ray's default
    eager = options("--autoscale", "1:2", "--slo-p95-ms", "800", "--autoscale-utilisation", "0.3")["autoscaling_config"]
    assert eager["policy"]["policy_kwargs"] == {"slo_s": 0.8, "low": 1, "high": 2, "utilisation": 0.3}


@pytest.mark.parametrize("flags, message", [
    (["--router", "least_work"], "--router only apply to Ray Serve replicas"),
    (["--replicas", "2", "--slo-p95-ms", "500"], "--slo-p95-ms steers the autoscaler; add --autoscale"),
    (["--replicas", "1", "--autoscale", "1:2", "--slo-p95-ms", "500", "--target-ongoing-requests", "2"],
     "two autoscaling policies"),
    (["--replicas", "1", "--autoscale", "1:2", "--autoscale-utilisation", "0.5"],
     "--autoscale-utilisation steers the SLO autoscaling policy; add --slo-p95-ms"),
    (["--replicas", "1", "--autoscale", "1:2", "--slo-p95-ms", "500", "--autoscale-utilisation", "1.5"],
     "--autoscale-utilisation: a fraction in (0, 1], got 1.5"),
])
def test_bad_fleet_flags_get_one_line_errors(flags, message, capsys, monkeypatch):
    monkeypatch.setattr("stepserve.commands.serve.available_cores", lambda: 4)
    assert serve_main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("stepserve serve: error: ") and message in err and err.count("\n") == 1, err


def proxied(rid: str, headers: dict[str, str], route: str = "/v1/images/generations", method: str = "POST"):
    """A request as Ray Serve's HTTP proxy hands it to the router: its ASGI scope pickled by the proxy's own code
    (the argument the replica unpickles), its route pattern and method in the metadata."""
    from ray.serve._private.common import RequestMetadata, RequestProtocol
    from ray.serve._private.proxy_request_response import ASGIProxyRequest
    from ray.serve.request_router import PendingRequest

    scope = {"type": "http", "method": method, "path": route,
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]}
    arg = ASGIProxyRequest(scope, None, None).serialized_replica_arg(proxy_actor_name="proxy")
    meta = RequestMetadata(rid, rid, route=route, _http_method=method, _request_protocol=RequestProtocol.HTTP)
    return PendingRequest(args=[arg], kwargs={}, metadata=meta)


def test_a_request_is_priced_at_its_own_steps_and_size_from_the_headers_a_client_sends():
    """The bench's headers (fleet.stats.work_headers), through the proxy's serialization, to the router's price:
    4 and 50 steps are priced apart (x12.5), a request twice the reference pixels at twice the price; without
    the headers, at the default steps."""
    from stepserve.fleet.headers import work_headers

    router = make_router(router="least_work")
    stats = ReplicaStats(outstanding=0, work_s=0.0, curve=(0.1,), fixed_s=0.2, pixels=512 * 512).to_dict()
    a = FakeReplica("a", {**stats, "taken_at": 1.0, "default_steps": 20})

    def price(headers, rid):
        async def route():  # a PendingRequest holds a future: made on a running loop, as in Ray
            pending = proxied(rid, headers)
            ranks = await router.choose_replicas([a], pending)
            pending.future.set_result(ranks[0][0])
            router.on_send_request("a")
            noted = router.sent.pending("a")[1]  # (requests, seconds) noted since the stats
            router.on_request_completed("a", rid)
            return noted

        return asyncio.run(route())

    four, fifty = price(work_headers(4, 512, 512), "r4"), price(work_headers(50, 512, 512), "r50")
    assert four == pytest.approx(4 * 0.1 + 0.2) and fifty == pytest.approx(50 * 0.1 + 0.2)
    assert price(work_headers(50, 1024, 512), "big") == pytest.approx(2 * fifty)
    assert price({}, "none") == pytest.approx(20 * 0.1 + 0.2)  # a client that says nothing: the default steps
    assert price(work_headers(4, None, None), "steps-only") == pytest.approx(four)
    async def poll():
        return router.job(proxied("poll", work_headers(50, 512, 512), "/v1/images/jobs/{job_id}", "GET"))

    assert asyncio.run(poll()).steps == 0  # a job's poll is not a generation, whatever it says

    async def handle_call():  # a call through a deployment handle: its bytes are never unpickled
        from ray.serve._private.common import RequestMetadata
        from ray.serve.request_router import PendingRequest

        evil = b"cos\nsystem\n(S'exit 3'\ntR."
        return router.job(PendingRequest(args=[evil], kwargs={}, metadata=RequestMetadata("h", "h")))

    assert asyncio.run(handle_call()).steps == 20


@pytest.mark.parametrize("headers,expected", [
    ({"x-stepserve-steps": "50", "x-stepserve-size": "1024x768"}, (50, 1024 * 768)),
    ({"X-StepServe-Steps": " 7 "}, (7, 0)),
    ({"x-stepserve-steps": "0"}, (0, 0)), ({"x-stepserve-steps": "-3"}, (0, 0)),
    ({"x-stepserve-steps": "²"}, (0, 0)), ({"x-stepserve-steps": "9" * 5000}, (0, 0)),
    ({"x-stepserve-steps": "10001"}, (0, 0)), ({"x-stepserve-size": "1024"}, (0, 0)),
    ({"x-stepserve-size": "0x512"}, (0, 0)), ({"x-stepserve-size": "99999x2"}, (0, 0)),
])
def test_work_headers_out_of_range_or_malformed_say_nothing(headers, expected):
    from stepserve.fleet.headers import work_of_headers

    assert work_of_headers([(k.encode(), v.encode()) for k, v in headers.items()]) == expected


def test_a_request_is_noted_at_its_own_price_though_ray_sends_another_first():
    """Ray ranks two requests, then its FIFO queue gives the first replica free to the oldest: each send is noted
    at the price of the request that went, not of the one ranked last."""
    from stepserve.fleet.headers import work_headers

    router = make_router(router="least_work")
    a = FakeReplica("a", {**ReplicaStats(curve=(0.1,)).to_dict(), "taken_at": 1.0, "default_steps": 20})

    async def race():
        long, short = proxied("long", work_headers(50, None, None)), proxied("short", work_headers(4, None, None))
        await router.choose_replicas([a], long)
        await router.choose_replicas([a], short)  # ranked last
        long.future.set_result(a)  # the oldest goes first
        router.on_send_request("a")
        after_long = router.sent.pending("a")[1]
        short.future.set_result(a)
        router.on_send_request("a")
        return after_long, router.sent.pending("a")[1]

    after_long, after_both = asyncio.run(race())
    assert after_long == pytest.approx(5.0) and after_both == pytest.approx(5.4)


def test_a_burst_before_any_replica_published_spreads_over_them():
    """Just after a deploy no replica has quoted a curve, so each predicts an instant finish: the tie goes to the
    fewest requests held (those this router has out there count), not always to the first replica."""
    assert sorted(burst(make_router(router="least_work"), [FakeReplica(name) for name in "abc"], 3)) == ["a", "b", "c"]


def test_a_replica_that_has_not_published_yet_is_priced_at_a_siblings_costs():
    """A replica just started (autoscaling up) has quoted no curve: priced at nothing, it would predict an instant
    finish and take a whole burst until it publishes. It is priced at a published sibling's costs, holding nothing,
    so a burst spreads over it and its idle sibling."""
    empty = {**ReplicaStats().to_dict(), "taken_at": 1.0, "models": {"m1": "disk"}}  # several models, none loaded
    for replicas in ([FakeReplica("old", published(0.0, 0, 1.0)), FakeReplica("new")],
                     [FakeReplica("new", empty), FakeReplica("old", published(0.0, 0, 1.0))]):
        sent = burst(make_router(router="least_work"), replicas, 6)
        assert sent.count("old") == sent.count("new") == 3


def test_past_the_quote_bound_a_request_given_up_goes_before_the_oldest(monkeypatch):
    """The quotes kept for sends are bounded: requests done (given up) are dropped first, and when none is, the
    newcomer goes unquoted, not the oldest (Ray gives a free replica to the request it was chosen for, else to the
    oldest waiting)."""
    from stepserve.fleet.headers import work_headers
    from stepserve.server.ray import router as module

    monkeypatch.setattr(module, "MAX_QUOTES", 2)
    router = make_router(router="least_work")
    a = FakeReplica("a", {**ReplicaStats(curve=(0.1,)).to_dict(), "taken_at": 1.0, "default_steps": 20})

    async def crowd():
        gone, old, new = (proxied(n, work_headers(s, None, None)) for n, s in (("gone", 7), ("old", 50), ("new", 4)))
        for p in (gone, old):
            await router.choose_replicas([a], p)
        gone.future.cancel()  # its client left before Ray sent it
        await router.choose_replicas([a], new)  # over the bound: "gone" makes room
        extra = proxied("extra", work_headers(9, None, None))
        await router.choose_replicas([a], extra)  # over the bound, nothing given up: "extra" goes unquoted
        old.future.set_result(a)
        router.on_send_request("a")
        first = router.sent.pending("a")[1]
        new.future.set_result(a)
        router.on_send_request("a")
        second = router.sent.pending("a")[1] - first
        extra.future.set_result(a)
        router.on_send_request("a")
        return first, second, router.sent.pending("a")[1] - first - second

    first, second, third = asyncio.run(crowd())
    assert first == pytest.approx(5.0) and second == pytest.approx(0.4)  # each at its own steps
    assert third == pytest.approx(2.0)  # unquoted: the default 20 steps
