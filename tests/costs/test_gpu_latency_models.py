"""The GPU latency models shipped in stepserve/models/latency/ (written from published figures by
benchmarks/gpu_latency_models.py): each loads, says where it comes from, and has the shape its metadata claims."""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path

import pytest

from stepserve.costs import LatencyModel

ROOT = Path(__file__).resolve().parents[2]
FILES = ("gpu-512-sublinear.json", "gpu-1024-compute-bound.json", "gpu-sd15-512.json")
ULYSSES = {n: f"gpu-1024-compute-bound-ulysses{n}.json" for n in (2, 4, 8)}


def shipped(name: str) -> LatencyModel:
    return LatencyModel.load(str(resources.files("stepserve") / "models" / "latency" / name))


def generator():
    spec = importlib.util.spec_from_file_location("gpu_latency_models", ROOT / "benchmarks" / "gpu_latency_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", FILES)
def test_each_model_loads_with_its_sources_and_covers_batch_1_to_16(name):
    m = shipped(name)
    meta = m.metadata
    assert meta["source"] and meta["figures"] and len(meta["assumptions"]) >= 4
    assert any("Decode" in a and "assumed" in a for a in meta["assumptions"])
    assert "guidance_rows" not in meta and "by_guidance_rows" not in meta  # main curves only, as said
    assert list(m.step) == [m.reference_bucket] and list(m.decode) == [m.reference_bucket]
    counts = [n for n, _ in m.step[m.reference_bucket].points]
    assert counts == list(range(1, 17)) == meta["batch_sizes"]
    steps = [m.step_s(n) for n in range(1, 17)]
    assert all(a < b for a, b in zip(steps, steps[1:])) and steps[0] > 0
    assert m.decode_s(1) > 0 and m.encode_s(1) > 0


@pytest.mark.parametrize("name", FILES + tuple(ULYSSES.values()))
def test_the_generator_writes_exactly_the_shipped_files(name):
    assert generator().MODELS[name]().to_dict() == shipped(name).to_dict()


def gains(m: LatencyModel) -> dict[int, float]:
    return {n: n * m.step_s(1) / m.step_s(n) for n in range(1, 17)}


def test_1024_is_compute_bound():
    m = shipped("gpu-1024-compute-bound.json")
    assert m.reference_bucket == (1024, 1024)
    assert m.step_s(8) >= 7 * m.step_s(1)
    assert gains(m)[2] == pytest.approx(1.02, abs=1e-3)  # SGLang, H200, 1024x1024
    assert m.step_s(1) == pytest.approx(0.150)  # xDiT FLUX.1-dev: 28 steps + encode + decode = 4.30 s
    assert 28 * m.step_s(1) + m.encode_s(1) + m.decode_s(1) == pytest.approx(4.30, abs=1e-3)


def test_512_is_sublinear_at_the_published_gains():
    m = shipped("gpu-512-sublinear.json")
    assert m.reference_bucket == (512, 512)
    g = gains(m)
    assert g[2] == pytest.approx(1.82, abs=2e-3) and g[16] == pytest.approx(3.21, abs=2e-3)
    assert m.step_s(16) < 5 * m.step_s(1)


def test_sd15_lies_in_between():
    lo, mid, hi = (gains(shipped(f)) for f in ("gpu-1024-compute-bound.json", "gpu-sd15-512.json",
                                              "gpu-512-sublinear.json"))
    for n in range(2, 17):
        assert lo[n] < mid[n] < hi[n]
        assert mid[n] == pytest.approx((lo[n] * hi[n]) ** 0.5, abs=2e-3)  # the geometric mean, as stated


def whole_image_s(m: LatencyModel) -> float:
    return 28 * m.step_s(1) + m.encode_s(1) + m.decode_s(1)


@pytest.mark.parametrize("degree, published_s", [(2, 2.68), (4, 1.63)])
def test_ulysses_variants_give_xdits_published_times(degree, published_s):
    """xDiT, FLUX.1-dev 1024x1024, 28 steps, compiled, H100s: Ulysses-2 2.68 s, Ulysses-4 1.63 s."""
    from stepserve.costs.degree import degree_label, devices_of

    m, one = shipped(ULYSSES[degree]), shipped("gpu-1024-compute-bound.json")
    assert devices_of(m) == degree and degree_label(m) == f"ulysses {degree}"
    assert whole_image_s(m) == pytest.approx(published_s, abs=2e-3)
    assert m.encode_s(1) == one.encode_s(1) and m.decode_s(8) == one.decode_s(8)  # the transformer only is split
    assert gains(m)[8] == pytest.approx(gains(one)[8], abs=1e-3)  # the batch shape is kept, as stated
    assert any("xDiT" in f for f in m.metadata["figures"])


def test_the_eight_device_variant_is_extrapolated_and_says_so():
    m, four = shipped(ULYSSES[8]), shipped(ULYSSES[4])
    assert m.step_s(1) == pytest.approx(four.step_s(1) * 30.8 / 39.6, abs=1e-6)  # vLLM-Omni's 4 -> 8 at 2048x2048
    assert any("extrapolated" in a for a in m.metadata["assumptions"])
    # splitting further helps each request less and less: step time x devices grows with the degree
    cost = [shipped(f).step_s(1) * n for n, f in [(1, "gpu-1024-compute-bound.json"), *ULYSSES.items()]]
    assert all(a < b for a, b in zip(cost, cost[1:]))
