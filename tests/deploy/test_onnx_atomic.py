"""ONNX exports are atomic: a failed re-export leaves the earlier export as it was (no new graphs beside a manifest
that says validated); the export cache leaves nothing behind on failure, and processes exporting the same model at
once export it once (the others wait and reuse it)."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from stepserve.deploy import onnx_cache, onnx_export
from stepserve.deploy.onnx_export import ExportError, export_onnx


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_failed_re_export_leaves_the_earlier_export_as_it_was(tiny_onnx, tiny_sd_path, tmp_path, monkeypatch):
    out = tmp_path / "export"
    shutil.copytree(tiny_onnx, out)
    before = _snapshot(out)
    monkeypatch.setattr(onnx_export, "TOLERANCE", {name: -1.0 for name in onnx_export.TOLERANCE})
    with pytest.raises(ExportError, match="onnxruntime differs from torch"):
        export_onnx(tiny_sd_path, out, opset=16, show_progress=False)  # other graphs than the opset 17 ones
    assert _snapshot(out) == before  # the graphs the manifest validated, untouched
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tiny_onnx.iterdir())  # no staging


def test_a_re_export_replaces_the_earlier_one(tiny_onnx, tiny_sd_path, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(tiny_onnx, out)
    (out / "stale.txt").write_text("from an earlier export")
    (out / ".staging-killed").mkdir()  # what a killed export leaves
    export_onnx(tiny_sd_path, out, validate=False, show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["validation"] == {} and not (out / "stale.txt").exists()
    assert not list(out.glob(".staging-*"))
    empty = tmp_path / "left-by-a-killed-export"
    (empty / ".staging-killed").mkdir(parents=True)
    export_onnx(tiny_sd_path, empty, validate=False, show_progress=False)  # accepted as an empty folder
    assert (empty / "manifest.json").is_file()


def _fake_export(calls, delay=0.0, fail=False):
    def export(model, out, **kwargs):
        calls.append(out)
        out.mkdir(parents=True)
        (out / "unet.onnx").write_text("graph")
        time.sleep(delay)
        if fail:
            raise ExportError("ONNX export of unet failed")
        (out / "manifest.json").write_text(json.dumps({"format": "stepserve-onnx"}))
        return out

    return export


def test_a_failed_cached_export_leaves_nothing_behind(tiny_sd_path, tmp_path, monkeypatch):
    monkeypatch.setenv("STEPSERVE_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(onnx_cache, "export_onnx", _fake_export(calls, fail=True))
    with pytest.raises(ExportError):
        onnx_cache.onnx_folder(tiny_sd_path)
    assert len(calls) == 1
    assert list((tmp_path / "onnx").iterdir()) == []  # no .partial-<pid>
    # a partial folder of a killed export is cleared by the next one
    (tmp_path / "onnx" / f"{onnx_cache.onnx_cache_dir(tiny_sd_path).name}.partial-1").mkdir()
    monkeypatch.setattr(onnx_cache, "export_onnx", _fake_export(calls))
    cached = onnx_cache.onnx_folder(tiny_sd_path)
    assert list((tmp_path / "onnx").iterdir()) == [cached]


def test_processes_exporting_at_once_export_once_and_share_it(tiny_sd_path, tmp_path, monkeypatch):
    monkeypatch.setenv("STEPSERVE_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(onnx_cache, "export_onnx", _fake_export(calls, delay=0.5))
    results, errors = [], []

    def replica():
        try:
            results.append(onnx_cache.onnx_folder(tiny_sd_path))
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=replica) for _ in range(3)]  # flock: each open() is its own lock owner
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(calls) == 1
    assert len(set(results)) == 1 and (results[0] / "manifest.json").is_file()
    assert not list((tmp_path / "onnx").glob("*.partial-*"))
