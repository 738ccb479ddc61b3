"""`Prefer: respond-async` as RFC 7240 says: a request whose preference was applied (a job) is answered with
`Preference-Applied: respond-async`; one answered synchronously (no Prefer, or a preference not understood, such
as the misspelt "respond-asynch") carries no Preference-Applied, so a client can tell which it got."""

from __future__ import annotations

from fastapi.testclient import TestClient
from server_helpers import GENERATIONS

from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app

BODY = {"prompt": "seven", "seed": 2, "num_inference_steps": 2, "guidance_scale": 1.0}


def test_preference_applied_only_when_the_request_became_a_job(tiny_executor):
    with TestClient(create_app(AsyncEngine(tiny_executor, strategy="continuous"))) as c:
        for prefer in ("respond-async", "wait=10, Respond-Async"):  # names without case, among others
            job = c.post(GENERATIONS, json=BODY, headers={"Prefer": prefer})
            assert job.status_code == 202 and job.headers["preference-applied"] == "respond-async", job.headers
        for headers in ({"Prefer": "respond-asynch"}, {}):
            sync = c.post(GENERATIONS, json=BODY, headers=headers)
            assert sync.status_code == 200 and "data" in sync.json()
            assert "preference-applied" not in sync.headers, sync.headers


def test_a_page_of_an_allowed_origin_may_send_prefer_and_read_the_answer(tiny_executor):
    """--cors-origin: a browser page may send Prefer (the preflight allows it) and read Preference-Applied and
    Location on the job's 202."""
    origin = "https://app.example.com"
    app = create_app(AsyncEngine(tiny_executor, strategy="continuous"), cors_origins=[origin])
    with TestClient(app) as c:
        preflight = c.options(GENERATIONS, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "content-type, prefer"})
        assert preflight.status_code == 200, preflight.text
        assert "prefer" in preflight.headers["access-control-allow-headers"].lower()
        job = c.post(GENERATIONS, json=BODY, headers={"Prefer": "respond-async", "Origin": origin})
        exposed = {h.strip().lower() for h in job.headers["access-control-expose-headers"].split(",")}
        assert job.status_code == 202 and {"preference-applied", "location"} <= exposed, job.headers
