"""The process-level life of a parallel model in a library user's process: one at a time (torch.distributed keeps
one default group per process), a start that fails after the ranks started leaves no worker and no group behind,
and the ranks meet through a file, not a port open to the network."""

from __future__ import annotations

import psutil
import pytest
import torch.distributed as dist
from rank_servers import HANG_S, kids

from stepserve import Engine, SamplingParams
from stepserve.parallel.degrees import Degrees


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux

    return str(build_tiny_flux(tmp_path_factory.mktemp("flux") / "flux"))


def _listening(proc: psutil.Process) -> list:
    return [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


@pytest.mark.slow  # a worker process imports torch and diffusers: about 6 s
def test_a_second_parallel_model_is_refused_and_the_first_keeps_serving(flux):
    children = kids()
    before = set(_listening(psutil.Process()))  # what other tests of this process may have left listening
    first = Engine.from_pretrained(flux, memory_cap=False, threads=1, degrees=Degrees(ulysses=2))
    try:
        # the rendezvous is a file: neither rank 0 nor a worker listens on anything but loopback
        opened = set(_listening(psutil.Process())) - before
        opened |= {a for pid in kids() - children for a in _listening(psutil.Process(pid))}
        assert [a for a in opened if a.ip not in ("127.0.0.1", "::1")] == []
        with pytest.raises(ValueError, match="another parallel model runs in this process"):
            Engine.from_pretrained(flux, memory_cap=False, threads=1, degrees=Degrees(ulysses=2))
        p = SamplingParams(prompt="a red boat", width=32, height=32, num_inference_steps=2, seed=3)
        assert first.generate([p])[0].ok
    finally:
        first.executor.close()
    assert not dist.is_initialized()
    assert kids() <= children


@pytest.mark.slow  # a worker process imports torch and diffusers: about 6 s
def test_a_start_that_fails_after_the_ranks_started_leaves_nothing_behind(flux, tmp_path):
    children = kids()
    with pytest.raises(ValueError, match="lora"):
        # the LoRA folder's memory is checked after the ranks have started
        Engine.from_pretrained(flux, memory_cap=False, threads=1, degrees=Degrees(ulysses=2),
                               lora_dir=str(tmp_path), lora_memory_mb="lots")
    assert kids() <= children
    assert not dist.is_initialized()


def test_on_the_cpu_ranks_times_threads_fit_the_cores(monkeypatch):
    import stepserve.engine.loading as loading
    from stepserve.engine.config import EngineConfig, _threads_per_rank

    monkeypatch.setattr(loading, "available_cores", lambda: 8)
    said = []
    config = EngineConfig(threads=7, degrees=Degrees(ulysses=2))
    assert _threads_per_rank(config, said.append).threads == 3 and "3 thread(s) per rank" in said[0]
    assert _threads_per_rank(EngineConfig(threads=3, degrees=Degrees(ulysses=2)), said.append).threads == 3


@pytest.mark.parametrize("fields, says", [
    ({"lora_dir": "loras"}, "--tensor-parallel-size 2 with --lora-dir is not served"),
    ({"device": "cuda:1"}, "the ranks take CUDA devices 0 to 1; allowed: --device cuda"),
])
def test_what_a_split_on_cuda_does_not_serve_is_one_line(fields, says):
    from stepserve.engine.config import EngineConfig
    from stepserve.engine.loading import check_pairs

    config = EngineConfig(**{"device": "cuda", "degrees": Degrees(tensor=2), **fields})
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        check_pairs(config, gpus=2)


@pytest.mark.slow  # a worker process imports torch and diffusers: about 6 s
def test_a_stopped_worker_fails_the_model_and_the_python_api_raises_an_exception(flux, monkeypatch):
    """SIGSTOP: the worker is alive but its peers would wait inside a collective until the group's timeout. The
    watcher fails the model once it has been stopped STOPPED_S; generate then raises EngineDeadError (an
    Exception a library user catches), not the BaseException the core stops on."""
    import os
    import signal
    import threading

    import stepserve.parallel.ranks as ranks
    from stepserve.engine.handles import EngineDeadError

    monkeypatch.setattr(ranks, "STOPPED_S", 1)
    children = kids()
    engine = Engine.from_pretrained(flux, memory_cap=False, threads=1, degrees=Degrees(ulysses=2))
    failed = threading.Event()
    engine.executor.on_failure.append(lambda why: failed.set())
    worker = engine.executor.ranks.processes[0]
    folder = engine.executor.ranks._folder  # the rendezvous file's, removed on close
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        assert failed.wait(HANG_S), "the watcher never failed the model"
        assert "has been stopped" in engine.executor.failure
        with pytest.raises(EngineDeadError, match="ranks failed"):
            engine.generate([SamplingParams(prompt="a boat", width=32, height=32, num_inference_steps=2, seed=1)])
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
        engine.executor.close()
    assert kids() <= children
    assert not os.path.exists(folder)
