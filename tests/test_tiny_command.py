"""`stepserve tiny KIND --out DIR`: a tiny random folder of any family, quietly, that the engine then serves."""

from __future__ import annotations

import importlib
import inspect

import pytest

from stepserve.cli import main as stepserve_main
from stepserve.commands.tiny import KINDS


def test_every_kind_names_a_builder_that_takes_its_options():
    for kind, (family, options) in KINDS.items():
        module = importlib.import_module(f"stepserve.tiny.{family}")
        parameters = inspect.signature(getattr(module, f"build_tiny_{family}")).parameters
        assert set(options) | set(getattr(module, "BENCH_OPTIONS", {})) <= set(parameters), kind


def test_tiny_writes_a_folder_quietly_that_the_engine_serves(tmp_path, capfd):
    from stepserve import Engine, SamplingParams

    out = tmp_path / "flux"
    assert stepserve_main(["tiny", "flux-schnell", "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert "wrote a flux-schnell folder" in err
    assert "Writing model shards" not in err and "torchvision" not in err, err
    engine = Engine.from_pretrained(str(out), memory_cap=False)
    assert engine.generate([SamplingParams(prompt="x", seed=1, num_inference_steps=2)])[0].ok


def test_tiny_refuses_a_folder_that_holds_a_model(tmp_path, capsys):
    out = tmp_path / "sd"
    assert stepserve_main(["tiny", "sd", "--out", str(out)]) == 0
    with pytest.raises(SystemExit) as exc:
        stepserve_main(["tiny", "sd", "--out", str(out)])
    assert exc.value.code == 2
    assert "already holds a model" in capsys.readouterr().err


def test_single_file_writes_a_denoiser_that_serve_flags_load(tmp_path, capfd):
    """`tiny single-file` writes the folder's transformer as GGUF; `serve`'s flags carry it (and --quantize) into
    the engine's config; a .gguf without --quant, or a file that exists, is refused."""
    from stepserve.commands.flags import weights_from_args
    from stepserve.commands.serve import build_parser
    from stepserve.engine.loading import load_executor

    folder = tmp_path / "flux"
    assert stepserve_main(["tiny", "flux-dev", "--out", str(folder)]) == 0
    out = tmp_path / "t.gguf"
    assert stepserve_main(["tiny", "single-file", "--model", str(folder), "--out", str(out), "--quant", "Q8_0"]) == 0
    assert f"--transformer {out}" in capfd.readouterr().err
    args = build_parser().parse_args(["--model", str(folder), "--transformer", str(out)])
    weights = weights_from_args(args)
    assert (weights.denoiser, weights.part, weights.quantize) == (str(out), "transformer", None)
    assert load_executor(str(folder), weights=weights).pipeline.networks.transformer is not None
    quantized = weights_from_args(build_parser().parse_args(["--model", str(folder), "--quantize", "int8wo"]))
    assert (quantized.denoiser, quantized.quantize) == (None, "int8wo")
    for argv, message in ((["--out", str(tmp_path / "u.gguf")], "--quant goes with a .gguf --out"),
                          (["--out", str(out), "--quant", "Q8_0"], "exists")):
        with pytest.raises(SystemExit) as exc:
            stepserve_main(["tiny", "single-file", "--model", str(folder), *argv])
        assert exc.value.code == 2 and message in capfd.readouterr().err


def test_controlnet_and_ip_adapter_write_folders_that_serve_flags_serve(tmp_path, tiny_sd_path, capfd):
    """`tiny controlnet` / `tiny ip-adapter` match `tiny lora`: a folder the server serves by its name from the
    folder above it (the line says the serve command); a model they are not written for is one line naming those
    they are, and leaves nothing behind."""
    from stepserve.controls.serving import serve_controlnets
    from stepserve.engine.loading import load_executor
    from stepserve.ipadapter.serving import serve_ip_adapters

    for kind, out, flag in (("controlnet", tmp_path / "cn" / "edges", "--controlnet-dir"),
                            ("ip-adapter", tmp_path / "ipa" / "face", "--ip-adapter-dir")):
        assert stepserve_main(["tiny", kind, "--model", str(tiny_sd_path), "--out", str(out)]) == 0
        err = capfd.readouterr().err
        assert f"serve it as '{out.name}'" in err and f"{flag} {out.parent}`" in err, err
    executor = load_executor(str(tiny_sd_path))
    assert "(edges)" in serve_controlnets(executor, str(tmp_path / "cn"), None)
    assert "(face)" in serve_ip_adapters(executor, str(tmp_path / "ipa"))
    with pytest.raises(SystemExit) as exc:  # the embedded UNet has no middle block: no ControlNet is made from it
        stepserve_main(["tiny", "controlnet", "--out", str(tmp_path / "cn" / "none")])
    err = capfd.readouterr().err
    assert exc.value.code == 2 and "cannot write the ControlNet for --model embedded" in err
    assert "written for SD 1/2" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "cn" / "none").exists()
    with pytest.raises(SystemExit):
        stepserve_main(["tiny", "ip-adapter", "--model", str(tiny_sd_path), "--out", str(tmp_path / "ipa" / "face")])
    assert "exists" in capfd.readouterr().err
