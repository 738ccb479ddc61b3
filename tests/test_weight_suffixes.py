"""Weight files are told apart by their suffix exactly as diffusers tells them apart: case-sensitively (diffusers
reads 'X.SAFETENSORS' as a pickle). A file whose suffix differs only in case is refused before anything is read,
saying to rename it; the add-on folders (LoRA adapters, ControlNets, IP-Adapters) list only what diffusers reads."""

from __future__ import annotations

import pytest

from stepserve.controls.store import discover as controlnets
from stepserve.ipadapter.parts import weight_files
from stepserve.lora.folder import discover as loras
from stepserve.pipelines.weights import Weights, check_checkpoint, check_denoiser_file


def test_a_denoiser_file_in_upper_case_is_refused_with_the_rename(tmp_path):
    upper = tmp_path / "unet.SAFETENSORS"
    upper.write_bytes(b"")
    with pytest.raises(ValueError, match=r"rename it to end in '\.safetensors'"):
        check_denoiser_file(Weights(denoiser=str(upper), part="unet"), ("unet",))
    gguf = tmp_path / "unet.GGUF"
    gguf.write_bytes(b"")
    with pytest.raises(ValueError, match=r"rename it to end in '\.gguf'"):
        check_denoiser_file(Weights(denoiser=str(gguf), part="unet"), ("unet",))
    lower = tmp_path / "unet.safetensors"
    lower.write_bytes(b"")
    check_denoiser_file(Weights(denoiser=str(lower), part="unet"), ("unet",))


def test_a_whole_model_file_in_upper_case_is_refused_with_the_rename(tmp_path):
    upper = tmp_path / "model.Safetensors"
    upper.write_bytes(b"")
    with pytest.raises(ValueError, match="rename it"):
        check_checkpoint(Weights(checkpoint=str(upper)), "StableDiffusionPipeline")


def test_add_on_folders_list_only_the_suffixes_diffusers_reads(tmp_path):
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "ink.SAFETENSORS").write_bytes(b"")
    (tmp_path / "lora" / "chalk.safetensors").write_bytes(b"")
    assert set(loras(tmp_path / "lora")) == {"chalk"}
    net = tmp_path / "cn" / "pose"
    net.mkdir(parents=True)
    (net / "config.json").write_text("{}")
    (net / "DIFFUSION_PYTORCH_MODEL.SAFETENSORS").write_bytes(b"")
    assert controlnets(tmp_path / "cn") == {}
    ip = tmp_path / "ip"
    ip.mkdir()
    (ip / "ip-adapter.SAFETENSORS").write_bytes(b"")
    (ip / "ip-adapter.bin").write_bytes(b"")
    assert [f.name for f in weight_files(ip)] == ["ip-adapter.bin"]
