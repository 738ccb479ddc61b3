"""bench --quality: the images that used step caching are compared with the same requests made without it, and
the report and results.json carry PSNR / SSIM beside latency; out of process it is refused."""

import json

import pytest

from stepserve.commands.bench import UsageError, config_from_args, main


def test_quality_of_cached_images_is_reported(tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"steps": [6], "cache": ["off", {"policy": "deepcache", "interval": 2}]}))
    out = tmp_path / "out"
    assert main(["--model", "embedded", "--strategies", "continuous", "--mix", str(mix), "--load", "closed",
                 "--users", "4", "--duration", "2", "--warmup", "0.5", "--quality", "--out", str(out),
                 "--no-progress", "--threads", "1"]) == 0
    summary = json.loads((out / "results.json").read_text())["summaries"][0]
    assert summary["cached_images"] > 0
    assert 20.0 < summary["psnr_db"] < 99.0 and 0.5 < summary["ssim"] < 1.0  # close to, not equal to, uncached
    assert 0.1 < summary["cached_step_frac"]["median"] < 0.5  # half the requests skip half their steps, ~0.25
    assert "## Step caching" in (out / "report.md").read_text()


def test_quality_needs_an_in_process_model():
    with pytest.raises(UsageError, match="--quality"):
        config_from_args(["--target", "http://127.0.0.1:1", "--quality"])
