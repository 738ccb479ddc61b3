"""Nothing is downloaded: a model folder given by a relative name, with a component or a file missing, is a clear
error naming what is missing, at once, with networking blocked (never a Hub repo id tried with retries)."""

import shutil
import socket
import time

import pytest

from stepserve.pipelines.folder import PipelineFolder
from stepserve.pipelines.registry import load_family_adapter


class NetworkUsed(BaseException):
    """Raised by any connection attempt; a BaseException so no retry loop can swallow it."""


@pytest.fixture
def no_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")

    def refuse(*args, **kwargs):
        raise NetworkUsed(f"a connection was attempted: {args[1:] or args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def sd15(tiny_sd_path, tmp_path, monkeypatch):
    """A copy of the tiny pipeline as the relative folder 'sd15' of the working directory."""
    shutil.copytree(tiny_sd_path, tmp_path / "sd15")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "sd15"


def test_a_missing_component_of_a_relative_folder_names_it_at_once(sd15, no_network):
    shutil.rmtree(sd15 / "tokenizer")
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=f"{sd15 / 'tokenizer'} is missing"):
        load_family_adapter("sd15")
    assert time.monotonic() - start < 60  # nothing retried or waited for (a network retry takes minutes)


def test_a_missing_weights_file_names_the_component(sd15, no_network):
    for weights in (sd15 / "unet").glob("diffusion_pytorch_model.*"):
        weights.unlink()
    with pytest.raises(FileNotFoundError, match=f"{sd15 / 'unet'}: UNet2DConditionModel cannot load it"):
        load_family_adapter("sd15")


def test_a_relative_folder_loads_offline_under_its_own_name(sd15, no_network):
    folder = PipelineFolder.open("sd15")
    assert folder.path == sd15 and folder.path.is_absolute() and folder.name == "sd15"
    adapter = load_family_adapter("sd15")
    assert adapter.info.name == "sd15"
