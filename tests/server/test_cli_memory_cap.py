"""`stepserve serve` lowers --max-batch-size to what fits in memory before it builds the engine."""

from __future__ import annotations

import pytest

from server_helpers import free_port

from stepserve.commands import serve as cli


@pytest.mark.parametrize("flag, expect_capped", [([], True), (["--no-memory-cap"], False)])
def test_serve_caps_max_batch_size_at_start_up(monkeypatch, tiny_sd_path, flag, expect_capped, capsys):
    seen = {}

    class Stop(Exception):
        pass

    def fake_cap(executor, requested, share=1.0, reserve_bytes=0):
        seen["requested"] = requested
        return 3, f"max_batch_size {requested} capped to 3: test"

    def fake_engine(executor, options):
        seen["options"] = options
        raise Stop

    monkeypatch.setattr("stepserve.profiling.cap_max_batch_size", fake_cap)
    monkeypatch.setattr("stepserve.engine.async_engine.AsyncEngine", fake_engine)
    with pytest.raises(Stop):
        cli.main(["--model", str(tiny_sd_path), "--max-batch-size", "64", "--threads", "1", "--port", free_port(),
                  *flag])
    assert seen["options"].max_batch_size == (3 if expect_capped else 64)
    assert ("capped to 3" in capsys.readouterr().err) == expect_capped
