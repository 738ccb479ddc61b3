"""--cfg-parallel on the transformer families with true classifier-free guidance (Qwen-Image, Wan): requests of
mixed sizes, steps and guidance (one unguided: no unconditional row) sent together give each request's image of one
process, within 1 of 255. The conditional rows run on rank 0, the unconditional ones on rank 1."""

from __future__ import annotations

import numpy as np
import pytest

from stepserve import Engine, SamplingParams
from stepserve.parallel.degrees import Degrees

pytestmark = pytest.mark.slow  # two model loads and a worker process per case: about 20 s each


def _requests(video: bool) -> list[SamplingParams]:
    frames = {"num_frames": 5} if video else {}
    return [SamplingParams(prompt="a cat on a wall", width=32, height=32, num_inference_steps=3, seed=1,
                           guidance_scale=3.0, **frames),
            SamplingParams(prompt="a dog", width=32, height=16, num_inference_steps=4, seed=2, guidance_scale=5.0),
            SamplingParams(prompt="a boat at sea", width=32, height=32, num_inference_steps=2, seed=3,
                           guidance_scale=1.0)]


def _images(engine, requests) -> list[np.ndarray]:
    outs = engine.generate(requests)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [np.asarray(o.image).astype(int) for o in outs]


@pytest.mark.parametrize("family", ["qwenimage", "wan"])
@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_cfg_parallel_gives_each_request_its_one_process_image(tmp_path, family, strategy):
    from stepserve.tiny.qwenimage import build_tiny_qwenimage
    from stepserve.tiny.wan import build_tiny_wan

    folder = (build_tiny_wan if family == "wan" else build_tiny_qwenimage)(tmp_path / family)
    requests = _requests(video=family == "wan")
    one = _images(Engine.from_pretrained(str(folder), memory_cap=False, strategy=strategy), requests)
    split = Engine.from_pretrained(str(folder), memory_cap=False, strategy=strategy, degrees=Degrees(cfg=True))
    try:
        assert split.executor.local.split.degrees.cfg  # rows really split over two ranks
        two = _images(split, requests)
    finally:
        split.executor.close()
    diffs = [int(np.abs(a - b).max()) for a, b in zip(one, two)]
    assert max(diffs) <= 1, diffs
