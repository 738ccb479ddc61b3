"""`stepserve serve`'s state flags: the start-up says which state store and results folder are in use (by default
a SQLite file in the user's state directory, here the test session's own); a state that cannot be opened, or a
webhook secret that is not a key, is one line and exit status 2, before the model loads."""

from __future__ import annotations

import os
import socket

import pytest
from server_helpers import free_port


def serve(argv: list[str], monkeypatch, capsys) -> tuple[int, str, list]:
    """Run `stepserve serve` in process up to the point where uvicorn would serve: (status, stderr, the apps)."""
    from stepserve.cli import main
    from stepserve.server.draining import DrainingServer

    ran = []
    monkeypatch.setattr(DrainingServer, "run", lambda self, sockets: ran.append(self.app))
    port = free_port()
    status = main(["serve", "--no-memory-cap", "--port", port, *argv])
    for app in ran:
        app.port = port
    return status, capsys.readouterr().err, ran


def test_the_default_state_is_a_sqlite_file_in_the_state_directory(monkeypatch, capsys):
    status, err, apps = serve([], monkeypatch, capsys)
    state_dir = os.path.join(os.environ["XDG_STATE_HOME"], "stepserve")
    assert status == 0 and len(apps) == 1, err
    line = next(ln for ln in err.splitlines() if "jobs: state" in ln)
    assert f"state sqlite:///{state_dir}/state.db" in line and f"results in {state_dir}/results" in line, line
    assert "(kept 24 h)" in line and "warning" not in err
    jobs = apps[0].state.server.jobs
    assert jobs.store.url == f"sqlite:///{state_dir}/state.db"
    assert jobs.owner == f"{socket.gethostname()}:{apps[0].port}"  # the same after a restart on this port


def test_state_results_keep_and_lease_flags_reach_the_app(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STEPSERVE_WEBHOOK_SECRET", "from-the-environment")
    db, results = tmp_path / "s" / "state.db", tmp_path / "r"
    status, err, apps = serve(["--state", f"sqlite:///{db}", "--results", str(results), "--keep-results-h", "2",
                               "--job-lease-s", "7"], monkeypatch, capsys)
    assert status == 0, err
    assert f"jobs: state sqlite:///{db}, results in {results} (kept 2 h)" in err
    jobs = apps[0].state.server.jobs
    assert (jobs.results.root, jobs.results.keep_s, jobs.runner.lease_s) == (results, 7200.0, 7.0)
    assert jobs.webhook_secret == "from-the-environment" and db.exists()


def test_memory_state_says_nothing_survives(monkeypatch, capsys):
    status, err, apps = serve(["--state", "memory"], monkeypatch, capsys)
    assert status == 0, err
    assert "jobs: state memory, results in a temporary folder (kept 24 h); nothing survives a restart" in err


@pytest.mark.parametrize("flags, says", [
    (["--state", "postgres://db/1"], "--state postgres://db/1: state 'postgres://db/1': allowed: memory, sqlite:///PATH"),
    (["--state", "sqlite:///"], "the path is empty"),
    (["--webhook-secret", "whsec_not base64!"], "--webhook-secret: the webhook secret starts with whsec_"),
])
def test_a_state_or_secret_that_cannot_be_used_is_one_line(flags, says, monkeypatch, capsys):
    status, err, apps = serve(flags, monkeypatch, capsys)
    assert status == 2 and apps == [], err
    lines = [ln for ln in err.splitlines() if ln.startswith("stepserve serve: error:")]
    assert len(lines) == 1 and says in lines[0], err
    assert "loading" not in err  # refused before the model loads


def test_results_that_cannot_be_a_folder_is_one_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status, err, _ = serve(["--state", f"sqlite:///{tmp_path}/s.db", "--results", str(blocker / "sub")],
                           monkeypatch, capsys)
    assert status == 2 and f"--results {blocker / 'sub'}: cannot use the folder" in err, err


def test_a_relative_state_file_is_made_absolute_with_its_results_beside_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, err, apps = serve(["--state", "sqlite:///new/state.db"], monkeypatch, capsys)
    assert status == 0, err
    db = tmp_path / "new" / "state.db"
    assert f"stepserve serve: created the folder {db.parent} for the state file" in err
    assert f"jobs: state sqlite:///{db}, results in {db.parent / 'results'} (kept 24 h)" in err
    jobs = apps[0].state.server.jobs
    assert jobs.store.url == f"sqlite:///{db}" and jobs.results.root == db.parent / "results"
    status, err, _ = serve(["--state", "sqlite:///new/state.db"], monkeypatch, capsys)
    assert status == 0 and "created the folder" not in err  # said once, when it was made


def test_service_and_job_max_attempts_reach_the_app(tmp_path, monkeypatch, capsys):
    status, err, apps = serve(["--state", f"sqlite:///{tmp_path}/s.db", "--service", "shop-images",
                               "--job-max-attempts", "5"], monkeypatch, capsys)
    assert status == 0, err
    jobs = apps[0].state.server.jobs
    assert (jobs.service, jobs.runner.max_attempts) == ("shop-images", 5) and "; service shop-images" in err
    status, err, apps = serve(["--state", f"sqlite:///{tmp_path}/s.db"], monkeypatch, capsys)
    derived = apps[0].state.server.jobs.service
    assert derived.startswith("embedded-") and f"; service {derived}" in err  # the model's own by default


def test_a_service_or_attempts_that_cannot_be_used_is_one_line(monkeypatch, capsys):
    status, err, apps = serve(["--service", "a/b"], monkeypatch, capsys)
    assert status == 2 and apps == [] and "--service 'a/b': allowed: 1 to 100 letters, digits" in err, err
    with pytest.raises(SystemExit) as exited:  # argparse's own refusal
        serve(["--job-max-attempts", "0"], monkeypatch, capsys)
    assert exited.value.code == 2
    assert "argument --job-max-attempts: expected an integer >= 1, got '0'" in capsys.readouterr().err
