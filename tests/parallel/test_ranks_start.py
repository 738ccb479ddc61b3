"""A split model's worker ranks at start-up: one that cannot load makes start-up fail with one line saying why,
and no process is left."""

from __future__ import annotations

import shutil

import pytest
from rank_servers import kids, tiny_flux


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tiny_flux(tmp_path_factory)


@pytest.mark.slow  # a worker process imports torch and diffusers
def test_a_worker_that_cannot_load_is_one_line_and_leaves_no_process(flux, tmp_path, capfd):
    from stepserve.engine.config import EngineConfig
    from stepserve.engine.loading import load_executor
    from stepserve.parallel.degrees import Degrees
    from stepserve.parallel.start import start_ranks

    before = kids()
    local = load_executor(str(flux))  # this rank loads; the workers' copy of the folder has lost its transformer
    broken = tmp_path / "pipe"
    shutil.copytree(flux, broken)
    shutil.rmtree(broken / "transformer")
    config = EngineConfig(model=str(broken), degrees=Degrees(ulysses=2), threads=1, warm_up=False)
    with pytest.raises(ValueError) as caught:
        start_ranks(local, config, say=lambda line: None)
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith("--ulysses-degree 2: rank 1 could not start: FileNotFoundError: model: "), message
    assert "transformer is missing" in message, message
    assert kids() <= before
    assert "could not start" not in capfd.readouterr().err  # rank 0 says it, once; the worker's stderr does not


def test_a_worker_that_ends_before_it_dials_back_is_one_line_and_leaves_no_process(flux, monkeypatch):
    import stepserve.parallel.ranks as ranks
    from stepserve.engine.config import EngineConfig
    from stepserve.engine.loading import load_executor
    from stepserve.parallel.degrees import Degrees
    from stepserve.parallel.start import start_ranks

    before = kids()
    monkeypatch.setattr(ranks, "WORKER_MODULE", "stepserve.no_such_module")  # the interpreter ends at once
    config = EngineConfig(model=str(flux), degrees=Degrees(ulysses=2), threads=1, warm_up=False)
    with pytest.raises(ValueError) as caught:
        start_ranks(load_executor(str(flux)), config, say=lambda line: None)
    message = str(caught.value)
    assert message.startswith("--ulysses-degree 2: worker rank 1 (pid ") and "\n" not in message, message
    assert message.endswith("exited with code 1 before it started"), message
    assert kids() <= before
