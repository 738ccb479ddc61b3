"""ONNX exports shared by the deploy tests: each model is exported (and checked against torch) once per session."""

from __future__ import annotations

import pytest
from extras import require


@pytest.fixture(scope="session")
def ort():
    require("onnx", "onnx")
    return require("onnxruntime", "onnx")


@pytest.fixture(scope="session")
def embedded_onnx(ort, tmp_path_factory):
    from stepserve.deploy.onnx_export import export_onnx

    return export_onnx("embedded", tmp_path_factory.mktemp("onnx") / "embedded", show_progress=False)


@pytest.fixture(scope="session")
def tiny_onnx(ort, tiny_sd_path, tmp_path_factory):
    from stepserve.deploy.onnx_export import export_onnx

    return export_onnx(tiny_sd_path, tmp_path_factory.mktemp("onnx") / "tiny", show_progress=False)
