"""What a model reads from Triton's initialize() arguments: its config's `parameters` and its version folder."""

from __future__ import annotations

import json
from pathlib import Path


def model_parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def version_dir(args: dict) -> Path:
    return Path(args["model_repository"]) / args["model_version"]


def optional_int(value: str | None) -> int | None:
    return int(value) if value not in (None, "", "none") else None


def limit_torch_threads(threads: int | None) -> None:
    """torch runs only the samplers here; its default pool (one thread per core) would fight onnxruntime's."""
    import torch

    torch.set_num_threads(threads or 1)
