"""What a loaded executor serves beyond its model: the default step caching and the add-on folders (LoRA,
ControlNet, IP-Adapter). One function, run by build_engine and by every worker rank of a parallel model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def serve_addons(executor: Any, config, budgets: dict, say: Callable[[str], None]) -> None:
    """`config`: the EngineConfig; `budgets`: each add-on kind's memory in MiB (a kind absent: no bound)."""
    if config.cache is not None:  # after the fast path, whose fixed-shape buckets run no caching
        _set_default_cache(executor, config.cache)
    if config.lora_dir is not None:
        from ..lora.serving import serve_folder

        say(serve_folder(executor, config.lora_dir, budgets.get("lora")))
    if config.controlnet_dir is not None:
        from ..controls.serving import serve_controlnets

        say(serve_controlnets(executor, config.controlnet_dir, budgets.get("controlnet")))
    if config.ip_adapter_dir is not None:
        from ..ipadapter.serving import serve_ip_adapters

        say(serve_ip_adapters(executor, config.ip_adapter_dir, budgets.get("ip_adapter")))


def _set_default_cache(executor: Any, cache: Any) -> None:
    """Requests that do not say cache as `cache` says; a ValueError names what this model and backend allow."""
    from ..caching.spec import CacheSpecError, parse_cache

    if not hasattr(executor, "default_cache"):
        raise ValueError(f"cache {cache!r}: step caching needs the torch backend")
    try:
        parse_cache(cache, executor.model_info)
    except CacheSpecError as exc:
        raise ValueError(f"cache: {exc}") from None
    executor.default_cache = cache
