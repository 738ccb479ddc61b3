"""The memory probe measures a large bucket at a small size of its aspect and scales the peaks by the pixels (at
least linearly, at most quadratically, by the growth it saw between two small sizes): start-up decodes no
1024x1024 image to cap the batch size, and the line says where it measured and how long it took."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from stepserve import profiling
from stepserve.profiling.probe_size import PROBE_PIXELS, ProbePlan, growth, probe_plan, scale_peaks

MODEL = SimpleNamespace(size_multiple=16, min_size=64)


@pytest.fixture(scope="module")
def large_executor(tiny_sd_path, tmp_path_factory):
    """The tiny SD serving sizes up to 64x64 (its stepserve.json): the memory cap is about its largest size, as
    a Flux.1 folder's is about 1024x1024 (the probe's size is made small to match: PROBE_PIXELS below)."""
    from stepserve.engine.loading import load_executor

    folder = tmp_path_factory.mktemp("large") / "pipe"
    shutil.copytree(tiny_sd_path, folder)
    (folder / "stepserve.json").write_text(json.dumps({"max_size": 64}))
    return load_executor(str(folder))


def test_a_small_bucket_is_measured_as_it_is_and_a_large_one_at_its_aspect():
    assert probe_plan(MODEL, (256, 256)) == ProbePlan((256, 256), (256, 256), None)
    assert probe_plan(MODEL, (1024, 1024)) == ProbePlan((1024, 1024), (256, 256), (128, 128))
    plan = probe_plan(MODEL, (512, 2048))  # the aspect kept, sides multiples of 16
    assert plan.small == (128, 512) and plan.smaller == (64, 256)
    assert probe_plan(MODEL, (9, 1024, 1024)).small == (9, 256, 256)  # a video keeps its frames
    tall = probe_plan(SimpleNamespace(size_multiple=16, min_size=256), (512, 512))
    assert tall.small == (256, 256) and tall.smaller is None  # no smaller size: measured growth unknown


def test_peaks_scale_by_the_pixels_with_the_growth_seen():
    plan = probe_plan(MODEL, (1024, 1024))  # 16x the pixels of the small size, which has 4x the smaller's
    assert growth(plan, 400, 100) == pytest.approx(1.0)
    assert growth(plan, 1600, 100) == pytest.approx(2.0)
    assert growth(plan, 800, 100) == pytest.approx(1.5)
    assert growth(plan, 150, 100) == 1.0  # fixed costs dominate small sizes: never less than linear
    assert growth(plan, 10**6, 1) == 2.0  # never more than quadratic
    assert growth(ProbePlan((64, 64), (64, 64), None), 100, None) == 1.0
    assert scale_peaks(plan, {1: 100, 4: 300}, 1.0) == {1: 1600, 4: 4800}
    assert scale_peaks(plan, {1: 100}, 2.0) == {1: 25600}
    assert scale_peaks(ProbePlan((64, 64), (64, 64), None), {2: 7}, 2.0) == {2: 7}


def test_the_cap_decodes_at_the_small_size_and_says_so(large_executor, monkeypatch):
    from stepserve.profiling import probe_size

    decoded = []
    real = large_executor.decode

    def decode(requests):
        decoded.extend((r.params.height, r.params.width) for r in requests)
        return real(requests)

    monkeypatch.setattr(large_executor, "decode", decode)
    monkeypatch.setattr(probe_size, "PROBE_PIXELS", 16 * 16)  # as 256x256 stands for 1024x1024
    assert large_executor.model_info.max_size == 64
    cap, why = profiling.cap_max_batch_size(large_executor, 4)
    assert cap == 4 and set(decoded) == {(16, 16), (8, 8)}, set(decoded)  # never 64x64
    assert decoded.count((8, 8)) == 2  # the smaller size: batch 1, after its unrecorded run
    assert "(64x64: " in why and "measured at 16x16 and scaled by pixels^" in why and " s)" in why, why
