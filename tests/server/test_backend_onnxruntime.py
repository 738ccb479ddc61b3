"""`stepserve serve --backend onnxruntime`: the same HTTP answers, with the networks run by onnxruntime."""

from __future__ import annotations

import httpx
import pytest
from extras import require
from server_helpers import GENERATIONS, assert_close, decode_png, free_port

from stepserve.commands import serve as cli


@pytest.fixture(scope="module")
def onnx_dir(tiny_sd_path, tmp_path_factory):
    require("onnxruntime", "onnx")
    from stepserve.deploy.onnx_export import export_onnx

    return export_onnx(tiny_sd_path, tmp_path_factory.mktemp("onnx") / "tiny", show_progress=False)


def _images(server, bodies):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        responses = [client.post(GENERATIONS, json=b) for b in bodies]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [decode_png(r.json()["data"][0]["b64_json"]) for r in responses]


def test_http_answers_on_onnxruntime_equal_torch(serve, onnx_dir):
    from stepserve.engine.loading import load_executor

    bodies = [{"prompt": p, "seed": s, "num_inference_steps": n, "guidance_scale": g}
              for p, s, n, g in (("a", 1, 3, 1.0), ("b", 2, 5, 4.0), ("a", 3, 4, 1.0))]
    with serve(strategy="continuous", max_batch_size=4) as server:
        want = _images(server, bodies)
    with serve(strategy="continuous", max_batch_size=4,
               executor=load_executor(str(onnx_dir), backend="onnxruntime", threads=1)) as server:
        got = _images(server, bodies)
    for a, b in zip(want, got):
        assert_close(a, b)


def test_serve_backend_flag_loads_onnxruntime_and_skips_the_torch_memory_cap(monkeypatch, onnx_dir, capsys):
    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(executor, options):
        seen["backend"] = executor.pipeline.backend
        seen["max_batch_size"] = options.max_batch_size
        raise Stop

    monkeypatch.setattr("stepserve.engine.async_engine.AsyncEngine", fake_engine)
    with pytest.raises(Stop):
        cli.main(["--model", str(onnx_dir), "--backend", "onnxruntime", "--max-batch-size", "16", "--threads", "1",
                  "--port", free_port()])
    assert seen == {"backend": "onnxruntime", "max_batch_size": 16}
    assert "no memory cap on backend onnxruntime" in capsys.readouterr().err


def test_serve_refuses_an_unknown_backend(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--backend", "tvm"])
    assert "invalid choice: 'tvm'" in capsys.readouterr().err
