"""What the sequence-parallel tests share (tests/parallel/test_sequence_*.py): a model served with
--ulysses-degree 2 on the CPU (two gloo ranks, one thread each), started once per test module and closed at its
end, and the checks that each request equals diffusers' pipeline alone, or itself served by one process."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from stepserve import Engine
from stepserve.parallel.degrees import Degrees

OPTIONS = dict(max_batch_size=4, max_queue_delay_ms=1)


@contextmanager
def split_engine(path, **kwargs):
    """An engine whose forwards run over two sequence ranks; its workers stop when the block ends."""
    engine = Engine.from_pretrained(str(path), degrees=Degrees(ulysses=2), threads=1, memory_cap=False,
                                    strategy="continuous", **{**OPTIONS, **kwargs})
    try:
        yield engine
    finally:
        engine.executor.close()


def with_strategy(engine, strategy: str, **options) -> Engine:
    """Another engine (policy, queue) on the same executor: the ranks start once per module."""
    return Engine(engine.executor, strategy=strategy, **{**OPTIONS, **options})


def one_process_with_lora(folder, controlnets, split, lora_dir, name: str, seed: int) -> Engine:
    """The same model on one process with the same add-ons: its ControlNets, and a random LoRA `name` loaded into it
    and into the split engine (on rank 0; the workers load it by file)."""
    from extras import require

    from stepserve.tiny.lora import build_tiny_lora

    require("peft", "lora")
    lora = build_tiny_lora(folder, lora_dir / f"{name}.safetensors", seed=seed, rank=4, std=0.3)
    engine = Engine.from_pretrained(str(folder), strategy="continuous", memory_cap=False,
                                    controlnet_dir=str(controlnets), max_batch_size=8)
    engine.executor.adapters().load(name, lora)
    split.executor.adapters().load(name, lora)
    return engine


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def as_video(result) -> np.ndarray:
    """A video request's frames, (frames, H, W, 3) int16."""
    return np.stack([pixels(f) for f in result.frames])


def assert_each_equals_one_process(split, one, requests) -> None:
    """Sent together to the split engine, every request gets the image (and skips the steps) it gets from one
    process alone (uint8 within 1), and the requests shared forwards."""
    alone = [one.generate([p])[0] for p in requests]
    together = split.generate(requests)
    assert all(r.ok for r in alone + together), [r.error for r in alone + together]
    assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for p, a, b in zip(requests, alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps, p
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1, p
