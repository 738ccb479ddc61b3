"""What an engine asks of its adapters: serve a folder at start-up, and, per step, that the adapters its requests
name are loaded and which modules' keys their rows apply (the executor calls these; the store maps names)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .errors import LoraBudgetError, LoraError, LoraUnsupportedError

log = logging.getLogger(__name__)


def serve_folder(executor: Any, lora_dir: str, memory_mb: float | None) -> str:
    """Serve LoRA adapters from `lora_dir` (folder.py: its files and subfolders, by name), loaded now in name order
    while `memory_mb` holds them and the rest on first use; more by POST /v1/loras. An adapter that cannot be
    served is left out with a warning (it is refused when a request names it); the server starts. A ValueError
    names the folder, or what this model or installation lacks to serve any adapter. Returns a line to log."""
    root = Path(lora_dir)
    if not root.is_dir():
        raise ValueError(f"lora_dir {lora_dir!r} is not a folder")
    if not hasattr(executor, "adapters"):
        raise ValueError("lora_dir: LoRA adapters need the torch backend")
    budget = None if memory_mb is None else int(memory_mb * 2**20)
    try:
        store = executor.adapters(root, budget)
        files = store.files()
        left_out = []
        for name, file in files.items():
            try:
                store.load(name, file)  # nothing is unloaded to make room here
            except LoraBudgetError:
                break
            except LoraUnsupportedError:
                raise
            except LoraError as exc:
                left_out.append(name)
                log.warning("LoRA adapter %r left out: %s", name, exc)
    except LoraUnsupportedError as exc:
        raise ValueError(f"lora_dir: {exc}") from None
    return (f"LoRA: {len(files)} adapter(s) in {root}, {len(store.adapters)} loaded now "
            f"({store.loaded_bytes / 2**20:.1f} MiB of {'no bound' if budget is None else f'{memory_mb:g} MiB'})"
            + (f"; left out (see the warnings): {', '.join(left_out)}" if left_out else "")
            + "; the rest load on first use")


def check_loaded(store, loras_lists) -> None:
    """Every adapter the rows name is loaded; else LookupError (the engine then isolates the request(s) by bisection
    and fails only them, instead of serving a silently plain image)."""
    missing = sorted({n for loras in loras_lists for n, _ in (loras or ())}) if store is None \
        else store.missing(loras_lists)
    if missing:
        raise LookupError(f"LoRA adapter(s) {', '.join(map(repr, missing))} are no longer loaded")


def row_keys(store, loras_lists):
    """The rows' (name, scale) lists as rows.adapter_rows applies them (the modules' keys); None: no adapter."""
    return store.key_rows(loras_lists) if store is not None and any(loras_lists) else None


def text_keys(store, loras) -> tuple:
    """A request's adapters that adapt a text encoder, as (key, scale): its prompts are encoded with them."""
    return store.text_adapters(loras) if store is not None and loras else ()
