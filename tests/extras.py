"""Optional integrations (package extras) in tests: skipped where an extra is not installed, except under CI,
where `make test` installs every extra and a missing one must fail the run instead of hiding behind a skip."""

from __future__ import annotations

import importlib
import os

import pytest


def require(module: str, extra: str):
    """Import `module` (from the `extra` package extra) or skip the test; under CI=true a missing one fails."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        message = f"{module} is missing: install stepserve[{extra}] (make test does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; CI installs every extra, so this fails instead of skipping ({e})")
        pytest.skip(message)
