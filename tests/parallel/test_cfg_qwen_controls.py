"""--cfg-parallel on Qwen-Image, whose unconditional row takes its conditional row's ControlNet outputs (as its
diffusers pipeline runs the ControlNet on the prompt only): the unconditional half runs the ControlNets on the
conditional rows of its guided requests (collated as one process collates them), and each request of a mixed batch
(guided and not, with and without controls, different windows) equals itself served by one process."""

import numpy as np
import pytest
import torch
from control_reference import build_controlnets, request
from edit_images import pixels

from stepserve import Engine
from stepserve.parallel.degrees import Degrees
from stepserve.tiny.qwenimage import build_tiny_qwenimage

pytestmark = [pytest.mark.usefixtures("batching_pays"), pytest.mark.slow]

CASES = [((), 4.0), ((("pose", 1.0, 0.0, 1.0),), 5.0), ((("depth", 0.9, 0.1, 0.9),), 1.0),
         ((("depth", 0.6, 0.3, 1.0),), 3.0), ((("pose", 0.8, 0.0, 0.5),), 1.0)]


def test_each_request_equals_one_process(tmp_path):
    pipe = build_tiny_qwenimage(tmp_path / "pipe")
    folder = build_controlnets(pipe, tmp_path / "controlnets")
    params = [request(i, controls, guidance=guidance, sampler="flow_euler", negative_prompt="blurry", steps=4)
              for i, (controls, guidance) in enumerate(CASES)]
    threads = torch.get_num_threads()
    options = dict(threads=1, memory_cap=False, strategy="continuous", max_batch_size=8, max_queue_delay_ms=1,
                   controlnet_dir=str(folder))
    want = Engine.from_pretrained(str(pipe), **options).generate(params)
    split = Engine.from_pretrained(str(pipe), degrees=Degrees(cfg=True), **options)
    try:
        got = split.generate(params)
    finally:
        split.executor.close()
        torch.set_num_threads(threads)  # the suite's (conftest): threads=1 set this process's
    assert all(r.ok for r in want + got), [r.error for r in want + got]
    assert max(max(r.timing.batch_sizes) for r in got) == len(params)
    for p, a, b in zip(params, want, got):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1, p
