"""`serve --quantize` at start-up: a missing library is one line before anything loads (no traceback); torchao's
warnings about the optional kernels it cannot load here stay out of the log; the start-up lines say the weights
are quantized beside the compute dtype."""

from __future__ import annotations

import logging
import sys

import pytest

from stepserve.pipelines.weights import Weights, check_quantize
from stepserve.util.ports import free_port


def test_quantize_without_torchao_is_one_line_before_anything_loads(monkeypatch, capsys):
    import stepserve.commands.serve as serve
    import stepserve.engine.loading as loading
    from stepserve.cli import main

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if stepserve[quant] were not installed
    monkeypatch.setattr(loading, "load_executor", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(serve, "open_state", lambda *a, **k: pytest.fail("the state was opened"))
    code = main(["serve", "--quantize", "int8wo", "--port", str(free_port())])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and lines == ["stepserve serve: error: --quantize int8wo needs torchao: pip install "
                                   "'stepserve[quant]'"], lines


def test_torchaos_kernel_warnings_are_quiet_while_it_is_imported(monkeypatch, tmp_path, caplog):
    """torchao logs a warning per CUDA-only .so it cannot load; its import under check_quantize keeps them out
    (a stand-in torchao that logs as the real one does, since the real one is imported once per process)."""
    package = tmp_path / "torchao"
    package.mkdir()
    (package / "__init__.py").write_text("import logging\nlogging.getLogger(__name__).warning("
                                         "'Failed to load /x/_C_mxfp8.so: Could not load this library')\n")
    pytest.importorskip("torchao")  # the real one in sys.modules first, so that the teardown puts it back
    monkeypatch.delitem(sys.modules, "torchao")
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.clear()  # what the real one logged as it was first imported here
    with caplog.at_level(logging.WARNING):
        check_quantize(Weights(quantize="int8wo"), "cpu")
    assert sys.modules["torchao"].__file__.startswith(str(tmp_path))
    assert not [r for r in caplog.records if "Failed to load" in r.getMessage()], caplog.records
    assert logging.getLogger("torchao").level == logging.NOTSET  # restored after the import


def test_start_up_lines_say_the_quantization(monkeypatch, capsys):
    import stepserve.server.startup as startup
    from stepserve.engine.config import EngineConfig

    weights = Weights(quantize="int8wo", quantize_text=True)
    assert weights.summary() == "denoiser and text encoders quantized int8wo (torchao Int8WeightOnlyConfig)"
    assert Weights(offload="model").summary() == "offload model"

    def stop(config, say):
        raise ValueError("stopped after the first line")

    monkeypatch.setattr(startup, "build_engine", stop)
    with pytest.raises(startup.StartupError):
        startup.start_engine(EngineConfig(model="embedded", weights=weights))
    assert "loading embedded on cpu (float32, denoiser and text encoders quantized int8wo (torchao " \
           "Int8WeightOnlyConfig), backend torch)" in capsys.readouterr().err
