"""What the environment capture cannot find out is logged, not silently dropped."""

import logging
import subprocess

from stepserve.bench import logs, resources


def test_git_failure_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(logs, "_said", set())

    def no_git(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "git")

    monkeypatch.setattr(subprocess, "run", no_git)
    with caplog.at_level(logging.DEBUG, logger="stepserve.bench.resources"):
        assert resources.git_commit() is None
        assert resources.git_commit() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no git commit" in warnings[0] and "FileNotFoundError" in warnings[0]


def test_git_commit_of_this_checkout_or_none():
    commit = resources.git_commit()
    assert commit is None or len(commit) == 40


def test_capture_environment_without_a_gpu_still_records_the_rest():
    env = resources.capture_environment(["bench"], "cpu")
    assert env.command == "stepserve bench" and env.cpu_count >= 1 and env.device == "cpu"
