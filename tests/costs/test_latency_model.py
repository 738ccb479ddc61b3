"""The latency model: interpolation rules, exact agreement with the fake executor's costs, and its file format."""

import json

import pytest

from stepserve.costs import CostModel
from stepserve.costs.latency_model import FORMAT_VERSION, Curve, LatencyModel
from stepserve.request.types import Request, SamplingParams


def test_curve_interpolates_and_extrapolates_linearly():
    c = Curve(((1, 1.0), (4, 2.5), (8, 4.5)))
    assert c(0) == 0.0
    assert c(1) == 1.0 and c(4) == 2.5 and c(8) == 4.5  # measured points exactly
    assert c(2) == pytest.approx(1.5) and c(6) == pytest.approx(3.5)  # between points
    assert c(10) == pytest.approx(5.5)  # past the last point: the last segment extended
    below = Curve(((2, 1.0), (4, 1.6)))
    assert below(1) == pytest.approx(0.7)  # before the first point: the first segment extended
    assert Curve(((2, 0.1), (3, 1.0)))(1) == 0.0  # never below zero
    assert Curve(((2, 0.5),))(6) == pytest.approx(1.5)  # one point: proportional to the count


@pytest.mark.parametrize("points, message", [
    ((), "at least one"),
    (((0, 1.0),), "integers >= 1"),
    (((1, 1.0), (1, 2.0)), "strictly increasing"),
    (((2, 1.0), (1, 2.0)), "strictly increasing"),
    (((1, -1.0),), "finite numbers >= 0"),
    (((1, float("nan")),), "finite numbers >= 0"),
])
def test_bad_curves_say_what_is_wrong(points, message):
    with pytest.raises(ValueError, match=message):
        Curve(points)


def fake_requests(n, size, guidance=3.0):
    return [Request(f"r{i}", SamplingParams(prompt="p", guidance_scale=guidance), 0.0, (size, size), 10)
            for i in range(n)]


@pytest.mark.parametrize("cost", [CostModel(), CostModel(step_fixed_s=0.05, step_per_item_s=0.011,
                                                         decode_per_item_s=0.02, reference_pixels=16 * 16)])
def test_from_cost_model_matches_the_fake_executor_exactly(cost):
    model = LatencyModel.from_cost_model(cost, buckets=[(16, 16), (32, 32), (64, 64)])
    for size in (16, 32, 64):
        for n in (1, 2, 3, 7, 16, 33):
            reqs = fake_requests(n, size)
            assert model.step_s(n, (size, size)) == pytest.approx(cost.step_s(reqs), rel=1e-12)
            assert model.decode_s(n, (size, size)) == pytest.approx(cost.decode_s(reqs), rel=1e-12)
            assert model.encode_s(n) == pytest.approx(cost.encode_s(reqs), rel=1e-12)
    no_cfg = LatencyModel.from_cost_model(cost, buckets=[(32, 32)], guidance=False)
    assert no_cfg.step_s(5) == pytest.approx(cost.step_s(fake_requests(5, 32, guidance=1.0)), rel=1e-12)


def test_unmeasured_bucket_scales_the_nearest_measured_one_by_pixels():
    model = LatencyModel(step={(16, 16): Curve(((1, 1.0), (2, 1.5))), (64, 64): Curve(((1, 9.0), (2, 12.0)))},
                         encode=Curve(((1, 0.1),)), decode={(16, 16): Curve(((1, 0.2),))})
    assert model.reference_bucket == (16, 16)
    assert model.step_s(2) == 1.5  # no bucket: the reference bucket
    assert model.step_s(2, (32, 32)) == pytest.approx(1.5 * 4)  # 1024 px is nearest to 16x16 (256 px)
    assert model.step_s(1, (64, 48)) == pytest.approx(9.0 * 3 / 4)  # nearest is 64x64
    assert model.decode_s(3, (32, 32)) == pytest.approx(0.6 * 4)


def model_with_metadata():
    model = LatencyModel.from_cost_model(CostModel(), buckets=[(32, 32), (16, 16)], reference_bucket=(16, 16))
    return LatencyModel(step=model.step, encode=model.encode, decode=model.decode,
                        reference_bucket=model.reference_bucket,
                        metadata={"device": "H200", "dtype": "float16", "versions": {"torch": "2.5"},
                                  "spread": {"step_p90_over_p50": 1.04}})


def test_json_round_trip_keeps_numbers_and_metadata(tmp_path):
    model = model_with_metadata()
    again = LatencyModel.from_json(model.to_json())
    assert again == model and again.metadata["device"] == "H200" and again.reference_bucket == (16, 16)
    path = tmp_path / "latency.json"
    model.save(path)
    loaded = LatencyModel.load(path)
    assert loaded == model
    assert loaded.step_s(5, (32, 32)) == model.step_s(5, (32, 32))
    assert json.loads(path.read_text())["version"] == FORMAT_VERSION


def _broken(change):
    data = model_with_metadata().to_dict()
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_broken(lambda d: d.update(format="something-else")), "not a stepserve latency model"),
    (_broken(lambda d: d.update(version=99)), "format version 99 is not supported"),
    (_broken(lambda d: d.pop("version")), "format version None is not supported"),
    (_broken(lambda d: d.pop("step")), "missing field 'step'"),
    (_broken(lambda d: d.update(step=[])), "step: expected a non-empty list"),
    (_broken(lambda d: d["step"][0].update(bucket=[32])), r"step\[0\]\.bucket: expected \[height, width\]"),
    (_broken(lambda d: d["step"][1].update(bucket=[32, 32])), r"step\[1\]\.bucket: \[32, 32\] is listed twice"),
    (_broken(lambda d: d["step"][0].update(points=[[2, 0.1], [1, 0.2]])),
     r"step\[0\]\.points: counts must be strictly increasing"),
    (_broken(lambda d: d["decode"][0].update(points=[[1, -0.5]])), r"decode\[0\]\.points: seconds must be"),
    (_broken(lambda d: d.update(encode="fast")), "encode: expected a list"),
    (_broken(lambda d: d.update(reference_bucket=[8, 8])), "reference_bucket"),
    (_broken(lambda d: d.update(metadata=[1])), "metadata: expected a JSON object"),
])
def test_bad_files_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        LatencyModel.load(path)
    assert str(path) in str(info.value)


def test_missing_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="cannot be read") as info:
        LatencyModel.load(tmp_path / "nope.json")
    assert "nope.json" in str(info.value)


def test_metadata_must_be_json():
    model = LatencyModel(step={(8, 8): Curve(((1, 1.0),))}, encode=Curve(((1, 0.0),)),
                         decode={(8, 8): Curve(((1, 0.0),))}, metadata={"when": object()})
    with pytest.raises(ValueError, match="metadata must be plain JSON"):
        model.to_json()


def test_zero_model_costs_nothing():
    z = LatencyModel.zero()
    assert z.step_s(8, (64, 64)) == z.encode_s(3) == z.decode_s(2, (32, 32)) == 0.0
