"""Text too long names the field it is about: a JSON body over the limit is a 413 naming its longest field (a
10 MB negative_prompt is not "shorten the prompt"), a body refused unread gives advice that fits any field, and a
negative_prompt over the model's limit says how long it is, as the prompt's message does."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from server_helpers import GENERATIONS, assert_error_shape

from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app


@pytest.fixture(scope="module")
def client(tiny_executor):
    with TestClient(create_app(AsyncEngine(tiny_executor, strategy="continuous"))) as c:
        yield c


def test_a_huge_negative_prompt_is_named(client):
    error = assert_error_shape(client.post(GENERATIONS, json={"prompt": "a fox", "negative_prompt": "x" * 10**7}), 413)
    assert error["param"] == "negative_prompt" and "negative_prompt is 10000000 characters" in error["message"]
    assert "64 KiB" in error["message"] and "shorten the prompt" not in error["message"]
    error = assert_error_shape(client.post(GENERATIONS, json={"prompt": "y" * 100_000}), 413)
    assert error["param"] == "prompt" and "prompt is 100000 characters" in error["message"]


def test_a_body_refused_unread_and_one_that_does_not_parse_get_general_advice(client):
    unparsed = b'{"prompt": "' + b"x" * 100_000  # not JSON: no field to name
    error = assert_error_shape(client.post(GENERATIONS, content=unparsed, headers={"Content-Type": "application/json"}),
                               413)
    assert error["param"] is None and "shorten its text fields (prompt, negative_prompt)" in error["message"]


def test_a_negative_prompt_over_the_models_limit_says_its_length(client):
    error = assert_error_shape(client.post(GENERATIONS, json={"prompt": "a", "negative_prompt": "x" * 3000}), 400)
    assert error["param"] == "negative_prompt"
    assert error["message"] == "negative_prompt: is 3000 characters; at most 2000 allowed", error
