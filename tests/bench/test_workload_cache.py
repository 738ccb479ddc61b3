"""A mix's `cache` field: drawn per request from the request's own seed, so the trace is otherwise the one without
it; it reaches the engine's params and the HTTP body, and survives a trace saved as CSV or JSONL."""

from stepserve.bench.trace_files import load_trace, save_trace
from stepserve.bench.workload import Mix, poisson_trace


def test_cache_leaves_the_rest_of_the_trace_unchanged():
    plain = poisson_trace(Mix.from_dict({"steps": [8, 20]}), 5.0, 20.0, seed=3)
    cached = poisson_trace(Mix.from_dict({"steps": [8, 20], "cache": ["off", {"policy": "deepcache",
                                                                                "interval": 2}]}), 5.0, 20.0, seed=3)
    assert [i.offset_s for i in plain.items] == [i.offset_s for i in cached.items]
    for a, b in zip(plain.items, cached.items):
        assert (a.spec.seed, a.spec.num_inference_steps, a.spec.prompt) == (b.spec.seed, b.spec.num_inference_steps,
                                                                            b.spec.prompt)
        assert a.spec.cache is None and b.spec.cache in ("off", {"policy": "deepcache", "interval": 2})
    kinds = {str(i.spec.cache) for i in cached.items}
    assert len(kinds) == 2  # both values drawn


def test_cache_reaches_params_http_and_saved_traces(tmp_path):
    trace = poisson_trace(Mix.from_dict({"cache": [{"policy": "fbcache", "threshold": 0.2}, "off"]}), 5.0, 10.0, 1)
    spec = trace.items[0].spec
    assert spec.to_params().cache == spec.cache and spec.to_http()["cache"] == spec.cache
    for name in ("t.csv", "t.jsonl"):
        save_trace(trace, tmp_path / name)
        assert [i.spec.cache for i in load_trace(tmp_path / name).items] == [i.spec.cache for i in trace.items]


def test_lora_mix_draws_one_adapter_per_request_from_its_seed(tmp_path):
    mix = Mix.from_dict({"steps": [8, 20], "lora": {"none": 1, "ink": 2, "oil": 2}})
    plain = poisson_trace(Mix.from_dict({"steps": [8, 20]}), 5.0, 20.0, seed=4)
    adapted = poisson_trace(mix, 5.0, 20.0, seed=4)
    assert [i.spec.seed for i in plain.items] == [i.spec.seed for i in adapted.items]
    seen = {None if i.spec.loras is None else i.spec.loras[0]["name"] for i in adapted.items}
    assert seen == {None, "ink", "oil"}
    spec = next(i.spec for i in adapted.items if i.spec.loras)
    assert spec.to_params().loras == spec.loras and spec.to_http()["loras"] == spec.loras
    save_trace(adapted, tmp_path / "t.csv")
    assert [i.spec.loras for i in load_trace(tmp_path / "t.csv").items] == [i.spec.loras for i in adapted.items]
