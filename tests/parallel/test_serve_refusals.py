"""What a split model cannot run is refused by `stepserve serve` at start-up: one line naming the flag and what it
needs, exit code 2, and no process left behind."""

from __future__ import annotations

import pytest
from rank_servers import free_port, kids, tiny_flux

from stepserve.cli import main


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tiny_flux(tmp_path_factory)


@pytest.fixture
def two_cores(monkeypatch):
    """This process may use 2 cores, whatever the machine has (the ranks-over-cores check counts them)."""
    import stepserve.engine.loading as loading

    monkeypatch.setattr(loading, "available_cores", lambda: 2)


def refusal(capsys, model, *flags: str) -> str:
    """`stepserve serve` with these flags: its one error line (exit code 2; no process started is left)."""
    before = kids()
    try:
        code = main(["serve", "--model", str(model), "--port", free_port(), "--threads", "1", "--no-memory-cap",
                     *flags])
    except SystemExit as exc:  # the flag parser's own refusals
        code = exc.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert lines and lines[-1].startswith("stepserve serve: error: "), lines
    assert not [line for line in lines if "error" in line.lower()][:-1], lines  # one line says it
    assert kids() <= before
    return lines[-1]


@pytest.mark.parametrize("flags, says", [
    (["--ring-degree", "2"], "--ring-degree needs an attention backend that returns the log-sum-exp (flash or cuDNN"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size needs CUDA devices"),
    (["--ulysses-degree", "4"], "--ulysses-degree 4 runs 4 ranks, one CPU thread each; this process may use 2 core(s)"),
    (["--ulysses-degree", "2", "--cfg-parallel"], "runs 4 ranks"),
    (["--ulysses-degree", "0"], "argument --ulysses-degree: expected an integer >= 1, got '0'"),
    (["--ulysses-degree", "2", "--compile"], "--ulysses-degree 2 with --compile is not served"),
    (["--ulysses-degree", "2", "--deterministic"], "--ulysses-degree 2 with --deterministic is not served"),
    (["--ulysses-degree", "2", "--offload", "model"], "--ulysses-degree 2 with --offload model is not served"),
])
def test_degrees_that_cannot_run_here_are_one_line_before_loading(capsys, two_cores, tiny_sd_path, flags, says):
    assert says in refusal(capsys, tiny_sd_path, *flags)


def test_a_unet_family_has_no_sequence_plan(capsys, tiny_sd_path):
    line = refusal(capsys, tiny_sd_path, "--ulysses-degree", "2")
    assert "has no sequence-parallel plan" in line and "allowed: --cfg-parallel" in line, line


def test_flux_has_no_unconditional_rows_to_split(capsys, flux):
    line = refusal(capsys, flux, "--cfg-parallel")
    assert "--cfg-parallel: Flux" in line and "allowed: --ulysses-degree" in line, line


def test_a_degree_that_does_not_divide_the_heads(capsys, monkeypatch, flux):
    import stepserve.engine.loading as loading

    monkeypatch.setattr(loading, "available_cores", lambda: 3)  # the heads are checked, not the cores
    line = refusal(capsys, flux, "--ulysses-degree", "3")
    assert "--ulysses-degree 3 does not divide" in line and "2 attention heads; allowed: a divisor of 2" in line, line


def test_more_ranks_than_gpus_is_one_line():
    from stepserve.parallel.degrees import Degrees, check_degrees

    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 4 needs 4 CUDA devices, one per rank; 2 visible"):
        check_degrees(Degrees(tensor=4), "cuda", "torch", cores=64, gpus=2)
    check_degrees(Degrees(tensor=2), "cuda", "torch", cores=1, gpus=2)  # one core: each rank drives its own GPU
