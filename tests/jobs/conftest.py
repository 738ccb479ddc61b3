"""Fixtures of the jobs tests: a tiny random Wan folder (video jobs), built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def wan_folder(tmp_path_factory):
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan_jobs") / "pipe")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: each test runs two engines (two processes' worth) on the machine's cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
