"""`stepserve serve --threads`: by default all cores this process may use but one, at least 1."""

from __future__ import annotations

import os

import pytest

from server_helpers import free_port

from stepserve.commands import serve as cli


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (3, 2), (16, 15)])
def test_default_threads_leave_one_core(monkeypatch, cores, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert cli.build_parser().parse_args([]).threads == expected


def test_default_follows_this_process_affinity_and_help_says_so(capsys):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert cli.build_parser().parse_args([]).threads == max(1, cores - 1)
    assert cli.build_parser().parse_args(["--threads", "3"]).threads == 3
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the cores this process may use minus one, at least 1" in help_text


def test_serve_applies_the_default_before_loading_the_model(monkeypatch, capsys):
    import torch

    import stepserve.engine.loading

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(5)), raising=False)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)

    def no_model(*args, **kwargs):
        raise OSError("not loaded in this test")

    monkeypatch.setattr(stepserve.engine.loading, "load_executor", no_model)
    assert cli.main(["--port", free_port()]) == 2
    assert calls == [4]
    assert "not loaded in this test" in capsys.readouterr().err
