"""Measuring a latency model from an executor, and the memory-aware batch cap."""

from __future__ import annotations

import sys

import pytest

from stepserve import profiling
from stepserve.costs import CostModel, FakeExecutor
from stepserve.costs.latency_model import LatencyModel
from stepserve.request.validation import ValidationError

COST = CostModel(step_fixed_s=0.0123, step_per_item_s=0.0041, encode_fixed_s=0.0031, encode_per_item_s=0.00071,
                 decode_fixed_s=0.0027, decode_per_item_s=0.0013)


class EngineLikeChecks(FakeExecutor):
    """A fake executor that also checks the requests are driven as the engine drives them: each denoise() at a
    step below num_inference_steps, one step further than the last denoise() of the same requests unless prepared again."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.last_step: dict[str, int] = {}
        self.prepares = 0

    def prepare(self, requests):
        self.prepares += 1
        for r in requests:
            assert r.step == 0
            self.last_step.pop(r.request_id, None)
        return super().prepare(requests)

    def denoise(self, requests):
        for r in requests:
            assert 0 <= r.step < r.num_inference_steps
            assert r.step == self.last_step.get(r.request_id, -1) + 1
            self.last_step[r.request_id] = r.step
        return super().denoise(requests)


def assert_same_costs(measured: LatencyModel, expected: LatencyModel, buckets, up_to: int) -> None:
    for n in range(0, up_to + 1):
        assert measured.encode_s(n) == pytest.approx(expected.encode_s(n), abs=1e-9), n
        for b in buckets:
            assert measured.step_s(n, b) == pytest.approx(expected.step_s(n, b), abs=1e-9), (n, b)
            assert measured.decode_s(n, b) == pytest.approx(expected.decode_s(n, b), abs=1e-9), (n, b)


# --- batch sizes ------------------------------------------------------------------------------------------------
def test_batch_sizes_are_all_up_to_16_then_geometric_with_both_ends():
    assert profiling.profile_batch_sizes(1) == [1]
    assert profiling.profile_batch_sizes(8) == list(range(1, 9))
    assert profiling.profile_batch_sizes(16) == list(range(1, 17))
    assert profiling.profile_batch_sizes(17) == [1, 2, 3, 4, 6, 8, 12, 16, 17]
    assert profiling.profile_batch_sizes(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert profiling.profile_batch_sizes(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="max_batch_size"):
            profiling.profile_batch_sizes(bad)


# --- the latency model from the fake executor: exact ----------------------------------------------------------------
@pytest.mark.parametrize("max_batch_size", [1, 8, 40])
def test_fake_executor_gives_exactly_its_cost_model(max_batch_size):
    executor = EngineLikeChecks(cost=COST)
    measured = profiling.measure_latency_model(executor, max_batch_size, progress=False)
    expected = LatencyModel.from_cost_model(COST, buckets=[(32, 32)], guidance=True)
    assert measured.reference_bucket == (32, 32)
    # within the measured sizes, and past them too once two points fix the line (one point is read as
    # proportional to the batch size, which the fixed costs are not)
    assert_same_costs(measured, expected, [(32, 32)], up_to=2 * max_batch_size + 5 if max_batch_size > 1 else 1)
    # every forward had the batch size of a measured point; (1 warmup + 5 repeats) per point
    sizes = profiling.profile_batch_sizes(max_batch_size)
    assert sorted(set(executor.forward_batch_sizes)) == sizes
    assert len(executor.forward_batch_sizes) == 6 * len(sizes)


def test_fake_executor_without_guidance_and_several_buckets():
    buckets = [(32, 32), (64, 64), (16, 48)]
    executor = EngineLikeChecks(cost=COST)
    measured = profiling.measure_latency_model(executor, 6, buckets=buckets, guidance_scale=1.0, progress=False)
    expected = LatencyModel.from_cost_model(COST, buckets=buckets, guidance=False)
    assert_same_costs(measured, expected, buckets, up_to=12)
    assert measured.reference_bucket == (32, 32)  # the model's default size
    assert measured.metadata["guidance_rows"] == 1 and measured.metadata["guidance_scale"] == 1.0
    # without the default size among the buckets, the first one is the reference
    other = profiling.measure_latency_model(FakeExecutor(cost=COST), 2, buckets=[(64, 64), (16, 16)],
                                            progress=False)
    assert other.reference_bucket == (64, 64)


def test_more_repeats_than_steps_prepares_again_and_stays_exact():
    # the fake model takes 20 steps: 30 denoising calls per point must start over instead of running past the end
    executor = EngineLikeChecks(cost=COST)
    measured = profiling.measure_latency_model(executor, 3, repeats=27, warmup=3, progress=False)
    expected = LatencyModel.from_cost_model(COST)
    assert_same_costs(measured, expected, [(32, 32)], up_to=6)
    assert len(executor.forward_batch_sizes) == 30 * 3
    assert executor.prepares == 3 * (30 + 1)  # 30 timed prepares per point, one more when the steps ran out


def test_metadata_and_spread_of_a_fake_measurement_and_json_round_trip(tmp_path):
    measured = profiling.measure_latency_model(FakeExecutor(cost=COST), 4, repeats=2, warmup=0, progress=False)
    meta = measured.metadata
    assert meta["model"] == "fake" and meta["executor"] == "FakeExecutor"
    assert meta["max_batch_size"] == 4 and meta["batch_sizes"] == [1, 2, 3, 4]
    assert meta["repeats"] == 2 and meta["warmup"] == 0 and meta["guidance_rows"] == 2
    assert meta["buckets"] == [[32, 32]] and meta["statistic"] == "median"
    assert "device" not in meta and "dtype" not in meta  # the fake executor has neither
    step_spread = meta["spread"]["step"][0]
    assert step_spread["bucket"] == [32, 32] and [p[0] for p in step_spread["points"]] == [1, 2, 3, 4]
    for n, lo, hi in step_spread["points"]:  # the fake's durations do not vary
        assert lo == pytest.approx(hi) == pytest.approx(measured.step_s(n))
    path = tmp_path / "latency.json"
    measured.save(path)
    assert LatencyModel.load(path).to_dict() == measured.to_dict()


class SlowSpells(FakeExecutor):
    """The fake's costs, but every `period`-th denoise() takes `factor` times as long (a machine's slow spell)."""

    def __init__(self, period: int, factor: float, **kwargs):
        super().__init__(**kwargs)
        self.period, self.factor, self.calls = period, factor, 0

    def denoise(self, requests):
        self.calls += 1
        cost = super().denoise(requests)
        return cost * self.factor if self.calls % self.period == 0 else cost


def test_rounds_sweep_every_point_in_turn_and_pool_their_samples():
    executor = EngineLikeChecks(cost=COST)
    measured = profiling.measure_latency_model(executor, 3, repeats=2, warmup=1, rounds=4, progress=False)
    assert_same_costs(measured, LatencyModel.from_cost_model(COST), [(32, 32)], up_to=6)
    # the sizes come round in turn: 1, 2, 3, 1, 2, 3, ... (3 forwards each), not 1 x 12, then 2 x 12, ...
    sizes = [executor.forward_batch_sizes[i] for i in range(0, len(executor.forward_batch_sizes), 3)]
    assert sizes == [1, 2, 3] * 4
    assert measured.metadata["rounds"] == 4
    with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
        profiling.measure_latency_model(executor, 2, rounds=0, progress=False)


def test_the_mean_counts_slow_steps_that_the_median_ignores():
    # one denoise() in 5 takes 3x as long: the median of 5 recorded runs is the fast cost, the mean is 1.4x of it
    kwargs = dict(max_batch_size=2, guidance_scale=1.0, repeats=5, warmup=0, progress=False)
    median = profiling.measure_latency_model(SlowSpells(5, 3.0, cost=COST), **kwargs)
    mean = profiling.measure_latency_model(SlowSpells(5, 3.0, cost=COST), statistic="mean", **kwargs)
    fast = LatencyModel.from_cost_model(COST, guidance=False)
    for n in (1, 2):
        assert median.step_s(n) == pytest.approx(fast.step_s(n))
        assert mean.step_s(n) == pytest.approx(1.4 * fast.step_s(n))
    assert mean.metadata["statistic"] == "mean"
    with pytest.raises(ValueError, match="statistic must be one of"):
        profiling.measure_latency_model(FakeExecutor(cost=COST), 2, statistic="p90", progress=False)


def test_progress_is_reported_unless_switched_off(capsys):
    profiling.measure_latency_model(FakeExecutor(cost=COST), 3, progress=None)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "profile fake: started (3 measurements)"
    assert lines[-1].startswith("profile fake: done 3 measurements")
    profiling.measure_latency_model(FakeExecutor(cost=COST), 3, progress=False)
    assert capsys.readouterr().err == ""


def test_bad_settings_are_refused_before_anything_runs():
    executor = FakeExecutor(cost=COST)
    with pytest.raises(ValueError, match="max_batch_size"):
        profiling.measure_latency_model(executor, 0, progress=False)
    with pytest.raises(ValueError, match="repeats"):
        profiling.measure_latency_model(executor, 2, repeats=0, progress=False)
    with pytest.raises(ValueError, match="warmup"):
        profiling.measure_latency_model(executor, 2, warmup=-1, progress=False)
    with pytest.raises(ValidationError, match="height"):
        profiling.measure_latency_model(executor, 2, buckets=[(33, 32)], progress=False)
    with pytest.raises(ValidationError, match="guidance_scale"):
        profiling.measure_latency_model(executor, 2, guidance_scale=-1.0, progress=False)
    with pytest.raises(ValueError, match="buckets"):
        profiling.measure_latency_model(executor, 2, buckets=[], progress=False)
    assert executor.forward_batch_sizes == []


# --- the tiny Stable Diffusion pipeline ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_executor(tiny_sd_path):
    from stepserve.engine.loading import load_executor

    return load_executor(str(tiny_sd_path))


def test_tiny_pipeline_gives_a_positive_growing_step_curve_with_metadata(tiny_executor, tmp_path):
    import torch

    cache = tiny_executor.pipeline.prompt_cache
    cache.put("kept", torch.zeros(1))
    measured = profiling.measure_latency_model(tiny_executor, 4, progress=False)
    bucket = (tiny_executor.model_info.default_height, tiny_executor.model_info.default_width)
    assert measured.reference_bucket == bucket
    steps = [s for _, s in measured.step[bucket].points]
    assert [n for n, _ in measured.step[bucket].points] == [1, 2, 3, 4]
    assert all(s > 0 for s in steps)
    for i in range(1, len(steps)):  # monotone up to timing noise
        assert steps[i] >= 0.5 * max(steps[:i]), steps
    assert measured.step_s(4) < 4 * measured.step_s(1), steps  # one forward of 4 beats four of 1
    assert all(s > 0 for _, s in measured.encode.points) and all(s > 0 for _, s in measured.decode[bucket].points)
    meta = measured.metadata
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["torch"] == torch.__version__
    assert meta["model"] == tiny_executor.model_info.name and meta["executor"] == "TorchExecutor"
    assert meta["threads"] == torch.get_num_threads() and meta["guidance_rows"] == 2
    spread = meta["spread"]["step"][0]["points"]
    lows, highs = [lo for _, lo, _ in spread], [hi for _, _, hi in spread]
    for n, lo, hi in spread:
        assert lo <= hi
        # the curve is made non-decreasing by pooling adjacent medians, so a point can leave its own spread,
        # never the spread of the points pooled with it
        assert min(lows) <= measured.step_s(n) <= max(highs)
    # the prompt cache was set aside while measuring and comes back as it was
    assert tiny_executor.pipeline.prompt_cache is cache and cache.get("kept") is not None
    assert not any(p.startswith("profile") for p in cache._items)
    path = tmp_path / "tiny.json"
    measured.save(path)
    loaded = LatencyModel.load(path)
    assert loaded.to_dict() == measured.to_dict()
    assert loaded.step_s(3) == measured.step_s(3) and loaded.metadata == measured.metadata


def test_tiny_pipeline_peak_memory_grows_with_the_batch(tiny_executor):
    peaks = profiling.measure_peak_memory(tiny_executor, [4, 1, 2])
    assert sorted(peaks) == [1, 2, 4]
    assert 0 < peaks[1] < peaks[2] < peaks[4]
    # at least the latents and the decoded images of the batch are live at some point
    h, w = tiny_executor.model_info.default_height, tiny_executor.model_info.default_width
    assert peaks[4] >= 4 * 3 * h * w * 4
    assert profiling.measure_peak_memory(tiny_executor, [2]) == {2: peaks[2]}  # the same run, the same bytes


def test_cap_keeps_the_request_when_memory_is_plentiful(tiny_executor):
    budget, what = profiling.memory_budget(tiny_executor)
    assert budget > 0
    assert "host memory" in what or "cgroup" in what
    size, why = profiling.cap_max_batch_size(tiny_executor, 8)
    assert size == 8 and why.startswith("max_batch_size 8 kept: 8 fits in "), why
    assert "20% headroom" in why and "\n" not in why
    assert profiling.cap_max_batch_size(tiny_executor, 1)[0] == 1


def test_cap_lowers_the_request_to_what_fits(tiny_executor, monkeypatch):
    peaks = profiling.measure_peak_memory(tiny_executor, [1, 2, 4], bucket=(32, 32))
    budget = peaks[4] * 10 / 0.8  # room for ~10 at the measured rate beyond 4 (plus what the fixed part allows)
    monkeypatch.setattr(profiling.memory, "memory_budget", lambda executor: (int(budget), "in the test budget"))
    expected = profiling.memory_cap(peaks, int(budget), 0.2)
    assert 4 < expected < 64
    size, why = profiling.cap_max_batch_size(tiny_executor, 64)
    assert size == expected
    assert why.startswith(f"max_batch_size 64 capped to {expected}: {expected} fits in "), why
    assert profiling.cap_max_batch_size(tiny_executor, 3)[0] == 3  # a smaller request is kept


def test_cap_after_running_out_of_memory_while_measuring(tiny_executor, monkeypatch):
    def run_out_at_4(executor, sizes, bucket):
        for n in sizes:
            if n == 4:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            yield n, 1000 * n

    monkeypatch.setattr(profiling.memory, "_iter_peaks", run_out_at_4)
    size, why = profiling.cap_max_batch_size(tiny_executor, 16)
    assert size == 3 and "a batch of 4" in why and "ran out of memory" in why

    def broken(executor, sizes, bucket):
        raise RuntimeError("profiler unavailable")
        yield  # pragma: no cover

    monkeypatch.setattr(profiling.memory, "_iter_peaks", broken)
    size, why = profiling.cap_max_batch_size(tiny_executor, 16)
    assert size == 16 and "could not be measured" in why and "profiler unavailable" in why


def test_cap_keeps_the_request_for_an_executor_without_device_memory():
    size, why = profiling.cap_max_batch_size(FakeExecutor(), 64)
    assert size == 64 and why.startswith("max_batch_size 64 kept: FakeExecutor has no torch device")
    with pytest.raises(ValueError, match="peak memory"):
        profiling.measure_peak_memory(FakeExecutor(), [1])
    with pytest.raises(ValueError, match="max_batch_size"):
        profiling.cap_max_batch_size(FakeExecutor(), 0)


@pytest.mark.skipif("torch" not in sys.modules or not sys.modules["torch"].cuda.is_available(), reason="no CUDA")
def test_cuda_peaks_and_metadata(tiny_sd_path):
    import torch

    from stepserve.engine.loading import load_executor

    executor = load_executor(str(tiny_sd_path), device="cuda")
    peaks = profiling.measure_peak_memory(executor, [1, 2, 4])
    assert 0 < peaks[1] <= peaks[2] <= peaks[4]
    size, why = profiling.cap_max_batch_size(executor, 8)
    assert size == 8 and "free on cuda" in why, why
    measured = profiling.measure_latency_model(executor, 2, progress=False)
    assert measured.metadata["device_name"] == torch.cuda.get_device_name(executor.device)


# --- memory_cap on synthetic peaks --------------------------------------------------------------------------------
@pytest.mark.parametrize("peaks, budget, headroom, expected", [
    ({1: 100, 2: 200, 4: 400}, 1000, 0.2, 8),  # proportional: 800 allowed -> 8
    ({1: 100, 2: 200, 4: 400}, 1000, 0.0, 10),
    ({2: 200, 4: 400}, 500, 0.2, 4),  # exactly at the limit fits
    ({2: 200, 4: 400}, 499, 0.2, 3),
    ({1: 1100, 2: 1200}, 2000, 0.0, 10),  # a fixed part plus 100 per request
    ({1: 100}, 1000, 0.2, 8),  # one point: proportional
    ({1: 300, 2: 100, 4: 400}, 1000, 0.2, 6),  # beyond the points: the steepest measured slope (150)
    ({1: 100, 2: 900, 4: 500}, 1000, 0.2, 1),  # 2 does not fit, so nothing above it is offered
    ({1: 100, 2: 200}, 50, 0.2, 1),  # nothing fits: still 1
    ({1: 100, 2: 200}, 0, 0.2, 1),
    ({1: 5000, 2: 5000}, 10000, 0.0, 4),  # flat peaks: beyond them in proportion to the last one
    ({4: 400, 8: 800, 16: 1600}, 1000, 0.2, 8),  # below the first point: along the first segment
])
def test_memory_cap_on_synthetic_peaks(peaks, budget, headroom, expected):
    assert profiling.memory_cap(peaks, budget, headroom) == expected


def test_memory_cap_at_large_sizes_and_bad_input():
    gib = 1024**3
    peaks = {1: 0.5 * gib, 2: 0.9 * gib, 4: 1.7 * gib}  # 0.4 GiB per request beyond a 0.1 GiB base
    # 18.2 GiB * 0.8 = 14.56 GiB -> 0.1 + 0.4 n <= 14.56 -> n = 36
    assert profiling.memory_cap(peaks, 18.2 * gib) == 36
    assert profiling.memory_cap({1: 0, 2: 0}, gib) == sys.maxsize  # nothing grows: nothing limits
    with pytest.raises(ValueError, match="peaks"):
        profiling.memory_cap({}, gib)
    with pytest.raises(ValueError, match="headroom"):
        profiling.memory_cap(peaks, gib, headroom=1.0)
    with pytest.raises(ValueError, match="peaks"):
        profiling.memory_cap({1: -5}, gib)
    with pytest.raises(ValueError, match="peaks"):
        profiling.memory_cap({0: 5}, gib)


def test_format_bytes():
    assert profiling.format_bytes(512) == "512 B"
    assert profiling.format_bytes(1536) == "1.5 KiB"
    assert profiling.format_bytes(3 * 1024**2) == "3.0 MiB"
    assert profiling.format_bytes(18.2 * 1024**3) == "18.2 GiB"



def test_curves_are_made_non_decreasing_without_touching_monotone_ones():
    from stepserve.profiling.measure import non_decreasing

    assert non_decreasing([(1, 1.0), (2, 2.0), (3, 3.0)]) == ((1, 1.0), (2, 2.0), (3, 3.0))
    fitted = non_decreasing([(1, 4.1), (2, 5.9), (3, 7.1), (4, 7.5), (5, 9.9), (6, 8.6), (7, 9.9), (8, 13.0)])
    ys = [y for _, y in fitted]
    assert all(a <= b for a, b in zip(ys, ys[1:]))
    assert ys[4] == ys[5] == pytest.approx((9.9 + 8.6) / 2) and ys[:4] == [4.1, 5.9, 7.1, 7.5]
    assert sum(ys) == pytest.approx(4.1 + 5.9 + 7.1 + 7.5 + 9.9 + 8.6 + 9.9 + 13.0)  # pooling keeps the mean


def test_a_model_that_embeds_guidance_is_measured_once_at_one_row_per_request():
    """Flux.1 dev and Flux.2 dev read the scale as a value (ModelInfo.guidance "embedded"): a request is one row at
    any scale, so the profile says so (guidance_rows 1) and does not measure a second, identical curve."""
    from dataclasses import replace

    from stepserve.costs.fake import FAKE_MODEL

    executor = FakeExecutor(replace(FAKE_MODEL, guidance="embedded", default_guidance_scale=3.5), cost=COST)
    measured = profiling.measure_with_and_without_guidance(executor, 2, progress=False)
    assert measured.metadata["guidance"] == "embedded" and measured.metadata["guidance_rows"] == 1
    assert "by_guidance_rows" not in measured.metadata
    cfg = profiling.measure_with_and_without_guidance(FakeExecutor(cost=COST), 2, progress=False)
    assert cfg.metadata["guidance"] == "cfg" and set(cfg.metadata["by_guidance_rows"]) == {"1", "2"}
