"""The fake executor charging a latency model (LatencyCharges): exactly what the latency model says, noise is
seeded and bounded, and the real engine runs a whole trace on it."""

from __future__ import annotations

import random
from importlib import resources

import pytest

from stepserve.costs import FAKE_MODEL, CostModel, FakeExecutor, LatencyCharges
from stepserve.costs.guidance import by_guidance_rows
from stepserve.costs.latency_model import Curve, LatencyModel
from stepserve.engine.core import EngineCore
from stepserve.scheduling import make_policy
from stepserve.sim import Arrival, simulate
from stepserve.request.types import Request, RequestStatus, SamplingParams

A, B = (32, 32), (64, 64)
# with guidance (2 rows per request) and without (1 row), per bucket: seconds at batch sizes 1, 2, 4
G = {A: ((1, 0.010), (2, 0.014), (4, 0.022)), B: ((1, 0.030), (2, 0.050), (4, 0.090))}
U = {A: ((1, 0.008), (2, 0.010), (4, 0.014)), B: ((1, 0.020), (2, 0.030), (4, 0.050))}
ENC_G, ENC_U = ((1, 0.004), (4, 0.007)), ((1, 0.002), (4, 0.004))
DEC = {A: ((1, 0.003), (4, 0.006)), B: ((1, 0.012), (4, 0.030))}


def _curves(points):
    return [{"bucket": list(b), "points": [list(p) for p in pts]} for b, pts in points.items()]


def _spread(points, lo=0.9, hi=1.2):
    return [[n, s * lo, s * hi] for n, s in points]


def two_curve_model() -> LatencyModel:
    entries = {}
    for rows, step, enc in (("1", U, ENC_U), ("2", G, ENC_G)):
        entries[rows] = {"guidance_scale": 3.0 if rows == "2" else 1.0, "step": _curves(step), "encode": list(
            map(list, enc)), "spread": {"step": [{"bucket": list(b), "points": _spread(p)} for b, p in step.items()],
                                        "encode": _spread(enc)}}
    spread = {"step": [{"bucket": list(b), "points": _spread(p)} for b, p in G.items()],
              "decode": [{"bucket": list(b), "points": _spread(p)} for b, p in DEC.items()],
              "encode": _spread(ENC_G)}
    return LatencyModel(step={b: Curve(p) for b, p in G.items()}, encode=Curve(ENC_G),
                        decode={b: Curve(p) for b, p in DEC.items()}, reference_bucket=A,
                        metadata={"guidance_rows": 2, "spread": spread, "by_guidance_rows": entries})


def executor(info, latency, noise=0.0, seed=0) -> FakeExecutor:
    return FakeExecutor(info, LatencyCharges(latency, noise, seed))


_ids = iter(range(10**9))


def req(bucket=A, guidance=3.0, steps=3) -> Request:
    params = SamplingParams(prompt="p", seed=1, num_inference_steps=steps, guidance_scale=guidance, sampler="euler",
                            height=bucket[0], width=bucket[1])
    return Request(request_id=f"r{next(_ids)}", params=params, arrival_time=0.0, bucket=bucket, num_inference_steps=steps,
                   status=RequestStatus.RUNNING, latents=0.0, sampler_state=[])  # as prepare() leaves it


def batch(n, guided, bucket=A):
    return [req(bucket, 3.0 if i < guided else 1.0) for i in range(n)]


@pytest.mark.parametrize("bucket", [A, B])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_pure_batches_cost_exactly_their_curve(bucket, n):
    ex = executor(FAKE_MODEL, two_curve_model())
    assert ex.denoise(batch(n, n, bucket)) == pytest.approx(Curve(G[bucket])(n), abs=1e-15)
    assert ex.denoise(batch(n, 0, bucket)) == pytest.approx(Curve(U[bucket])(n), abs=1e-15)
    assert ex.prepare(batch(n, n, bucket)) == pytest.approx(Curve(ENC_G)(n), abs=1e-15)
    assert ex.prepare(batch(n, 0, bucket)) == pytest.approx(Curve(ENC_U)(n), abs=1e-15)
    done = batch(n, n, bucket)
    assert ex.decode(done) == pytest.approx(Curve(DEC[bucket])(n), abs=1e-15)
    assert all(r.image is not None and r.image == r.latents for r in done)
    # the main curves are the guided ones, as the slo policy plans with them
    assert ex.denoise(batch(n, n, bucket)) == pytest.approx(two_curve_model().step_s(n, bucket), abs=1e-15)


def test_mixed_batches_are_linear_in_guidance_rows_and_decode_sums_buckets():
    ex = executor(FAKE_MODEL, two_curve_model())
    u, g = Curve(U[B])(4), Curve(G[B])(4)
    assert ex.denoise(batch(4, 1, B)) == pytest.approx(u + (g - u) / 4)
    assert ex.denoise(batch(4, 3, B)) == pytest.approx(u + 3 * (g - u) / 4)
    assert ex.cost.seconds("step", 4, 1, B) == pytest.approx(u + (g - u) / 4)
    assert ex.decode(batch(2, 2, A) + batch(3, 0, B)) == pytest.approx(Curve(DEC[A])(2) + Curve(DEC[B])(3))
    # an unmeasured bucket: the nearest measured one, scaled by pixels (as LatencyModel does)
    assert ex.denoise(batch(2, 2, (32, 48))) == pytest.approx(Curve(G[A])(2) * 1.5)
    with pytest.raises(ValueError, match="mixes shape buckets"):
        ex.denoise(batch(1, 1, A) + batch(1, 1, B))
    assert ex.denoise([]) == ex.prepare([]) == ex.decode([]) == 0.0


@pytest.mark.parametrize("guided", [0, 1, 3, 5])
def test_a_single_curve_is_charged_by_rows_exactly_as_the_fake_cost_model(guided):
    cost = CostModel()
    model = LatencyModel.from_cost_model(cost, buckets=[A, B], guidance=True)
    ex = executor(FAKE_MODEL, model)
    for bucket in (A, B):
        b = batch(5, guided, bucket)
        assert ex.denoise(b) == pytest.approx(cost.step_s(b))
        assert ex.decode(b) == pytest.approx(cost.decode_s(b))
    assert set(by_guidance_rows(model)) == {2}


def test_embedded_guidance_adds_no_row():
    """A model that embeds the guidance scale (Flux.1 dev, Flux.2 dev: metadata "guidance": "embedded") runs one
    row per request whatever the scale, so a batch of guided requests costs the curve at its size; the same curve
    on a classifier-free-guidance model charges each guided request its second row."""
    step = {A: Curve(((1, 0.010), (4, 0.040), (8, 0.080)))}
    common = dict(step=step, encode=Curve(((1, 0.002), (8, 0.009))), decode={A: Curve(((1, 0.003), (8, 0.010)))})
    embedded = LatencyModel(**common, metadata={"guidance_rows": 1, "guidance": "embedded"})
    cfg = LatencyModel(**common, metadata={"guidance_rows": 1, "guidance": "cfg"})
    b = batch(4, 4, A)
    assert executor(FAKE_MODEL, embedded).denoise(b) == pytest.approx(0.040)
    assert executor(FAKE_MODEL, cfg).denoise(b) == pytest.approx(0.080)  # 8 rows


def test_noise_is_deterministic_per_seed_and_within_the_spread():
    model = two_curve_model()

    def run(seed, noise=1.0):
        ex = executor(FAKE_MODEL, model, noise=noise, seed=seed)
        rng = random.Random(99)
        out = []
        for _ in range(300):
            n, bucket = rng.choice([1, 2, 4]), rng.choice([A, B])
            guided = rng.choice([0, n])
            out.append(("step", n, guided, bucket, ex.denoise(batch(n, guided, bucket))))
            out.append(("encode", n, guided, bucket, ex.prepare(batch(n, guided, bucket))))
            out.append(("decode", n, 0, bucket, ex.decode(batch(n, 0, bucket))))
        return ex, out

    ex, first = run(7)
    assert first == run(7)[1]
    assert [x[-1] for x in first] != [x[-1] for x in run(8)[1]]
    for stage, n, guided, bucket, seconds in first:
        exact = ex.cost.seconds(stage, n, guided, bucket)
        assert 0.9 * exact - 1e-12 <= seconds <= 1.2 * exact + 1e-12
    assert len({s for *_, s in first}) > 100  # it does vary
    # half the noise: half the spread around the curve
    ex, half = run(7, noise=0.5)
    for stage, n, guided, bucket, seconds in half:
        exact = ex.cost.seconds(stage, n, guided, bucket)
        assert 0.95 * exact - 1e-12 <= seconds <= 1.1 * exact + 1e-12


def test_bad_noise_and_noise_without_a_spread_are_refused():
    with pytest.raises(ValueError, match="noise must be"):
        executor(FAKE_MODEL, two_curve_model(), noise=-0.1)
    with pytest.raises(ValueError, match="spread"):
        executor(FAKE_MODEL, LatencyModel.from_cost_model(CostModel()), noise=0.5)


def trace(n, seed=0):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(400.0)
        bucket = rng.choice([A, B])
        out.append(Arrival(t, SamplingParams(prompt=f"p{i}", seed=i, num_inference_steps=rng.choice([5, 10]),
                                             guidance_scale=rng.choice([1.0, 3.0]), height=bucket[0],
                                             width=bucket[1])))
    return out


@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_the_real_engine_finishes_every_request_of_a_trace(strategy):
    model = two_curve_model()
    ex = executor(FAKE_MODEL, model, noise=1.0, seed=3)
    core = EngineCore(ex, make_policy(strategy, 8, latency_model=model))
    arrivals = trace(400)
    result = simulate(core, arrivals)
    assert len(result.requests) == 400
    assert all(r.status is RequestStatus.COMPLETED and r.image is not None for r in result.requests)
    assert all(r.step == r.num_inference_steps for r in result.requests)
    busy = sum(s.duration_s for s in result.steps)
    assert 0 < busy <= result.end_time
    # the same seed gives the same run
    again = simulate(EngineCore(executor(FAKE_MODEL, model, noise=1.0, seed=3),
                                make_policy(strategy, 8, latency_model=model)), trace(400))
    assert again.end_time == result.end_time


def test_the_shipped_example_model_loads_and_drives_the_embedded_model_info():
    path = resources.files("stepserve") / "models" / "latency" / "embedded-cpu.json"
    model = LatencyModel.load(str(path))
    meta = model.metadata
    assert meta["model"] == "embedded" and meta["backend"] == "torch" and meta["threads"] == 1
    assert meta["max_batch_size"] == 16 and "processor" in meta["machine"] and "note" in meta
    curves = by_guidance_rows(model)
    assert set(curves) == {1, 2}
    assert model.step_s(16) > model.step_s(1) > 0
    info = FAKE_MODEL  # same default size (32x32) as the embedded model
    ex = executor(info, model, noise=1.0, seed=0)
    result = simulate(EngineCore(ex, make_policy("continuous", 16)), trace(200, seed=1))
    assert all(r.status is RequestStatus.COMPLETED for r in result.requests)


def test_a_malformed_guidance_entry_is_refused_naming_it():
    good = two_curve_model().to_dict()
    bad = {**good, "metadata": {**good["metadata"], "by_guidance_rows": {"3": {}}}}
    with pytest.raises(ValueError, match=r"metadata.by_guidance_rows: keys are rows per request.*'3'"):
        executor(FAKE_MODEL, LatencyModel.from_dict(bad))
    entries = dict(good["metadata"]["by_guidance_rows"])
    entries["1"] = {**entries["1"], "encode": [[0, 1.0]]}
    bad = {**good, "metadata": {**good["metadata"], "by_guidance_rows": entries}}
    with pytest.raises(ValueError, match=r"metadata.by_guidance_rows.1: encode: counts must be integers >= 1"):
        by_guidance_rows(LatencyModel.from_dict(bad))
