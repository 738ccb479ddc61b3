"""`stepserve serve`'s network flags reach the app (--allowed-host: the Host check of a keyless server;
--webhook-allow: internal receivers), and a state URL's password is never shown: not in the start-up lines, not in
a `--state` error, not in the settings' repr, not in what is pickled for Ray replicas (which read it from their own
STEPSERVE_STATE)."""

from __future__ import annotations

import ipaddress
import pickle

import pytest
from fastapi.testclient import TestClient
from test_serve_state_flags import serve

from stepserve.commands.serve import build_parser, serve_settings
from stepserve.server.startup import StartupError, for_replicas, open_state, replica_state_url, state_line

PASSWORD = "pw-7f3a9c"


def test_the_network_flags_reach_the_app(monkeypatch, capsys):
    status, err, apps = serve(["--state", "memory", "--allowed-host", "images.example", "--webhook-allow",
                               "10.0.0.0/8", "--webhook-allow", "hooks.internal"], monkeypatch, capsys)
    assert status == 0, err
    targets = apps[0].state.server.webhook_targets
    assert targets.networks == (ipaddress.ip_network("10.0.0.0/8"),) and targets.hosts == {"hooks.internal"}
    with TestClient(apps[0], base_url="http://127.0.0.1") as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers={"Host": "images.example:8000"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403


def test_a_bad_webhook_allow_is_one_line(monkeypatch, capsys):
    status, err, apps = serve(["--state", "memory", "--webhook-allow", "10.0.0.0/33"], monkeypatch, capsys)
    assert status == 2 and apps == [] and "--webhook-allow '10.0.0.0/33': not a network" in err, err


@pytest.mark.parametrize("url", [f"redis://:{PASSWORD}@127.0.0.1:1/0", f"redis://u:{PASSWORD}@127.0.0.1:1/0",
                                 f"redis://127.0.0.1:1/0?password={PASSWORD}", f"postgres://:{PASSWORD}@db/1",
                                 f"redis:/:{PASSWORD}@127.0.0.1:1/0"])
def test_a_state_that_cannot_be_opened_never_shows_its_password(url, monkeypatch, capsys):
    status, err, apps = serve(["--state", url], monkeypatch, capsys)
    assert status == 2 and apps == [] and "stepserve serve: error: --state " in err, err
    assert PASSWORD not in err


def settings_for(url: str, *flags: str):
    return serve_settings(build_parser().parse_args(["--state", url, "--no-memory-cap", *flags]))


def test_the_banner_repr_and_replicas_never_carry_the_password(monkeypatch):
    url = f"redis://:{PASSWORD}@redis.internal:6379/0"
    settings = settings_for(url, "--api-key", "key-1d2e", "--webhook-secret", "hook-4b5c")
    assert "state redis://redis.internal:6379/0, results in" in state_line(settings, "/results")
    assert PASSWORD not in state_line(settings, "/results")
    assert not {PASSWORD, "key-1d2e", "hook-4b5c"} & set(repr(settings).replace("'", " ").split())
    travels = for_replicas(settings)
    assert travels.state_url == "redis://redis.internal:6379/0" and travels.state_password_required
    assert PASSWORD.encode() not in pickle.dumps(travels) and b"key-1d2e" not in pickle.dumps(travels)
    monkeypatch.delenv("STEPSERVE_STATE", raising=False)
    with pytest.raises(StartupError, match="has a password but this replica finds none: set STEPSERVE_STATE") as e:
        open_state(travels)
    assert PASSWORD not in str(e.value)
    monkeypatch.setenv("STEPSERVE_STATE", url)  # a local cluster inherits it from `serve`
    assert replica_state_url(travels) == url
    monkeypatch.setenv("STEPSERVE_STATE", f"redis://:{PASSWORD}@elsewhere:6379/0")  # another store: refused
    with pytest.raises(StartupError, match="finds none"):
        replica_state_url(travels)
    plain = settings_for("memory")
    assert for_replicas(plain) == plain and replica_state_url(plain) == "memory"
