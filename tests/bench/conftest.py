"""Fixtures shared by the bench tests."""

import pytest


@pytest.fixture
def submitted(monkeypatch):
    """The SamplingParams every in-process engine was given, in order."""
    from stepserve.engine.async_engine import AsyncEngine

    seen = []
    original = AsyncEngine.submit

    def submit(self, params, *args, **kwargs):
        seen.append(params)
        return original(self, params, *args, **kwargs)

    monkeypatch.setattr(AsyncEngine, "submit", submit)
    return seen
