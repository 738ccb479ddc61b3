"""Each add-on kind's memory (--lora-memory-mb, --controlnet-memory-mb, --ip-adapter-memory-mb): its default, sized
for the dtype in force, and each kind's name in the memory cap's line (which keeps each memory out of the
batches' budget). No torch.

The defaults are given for 16-bit weights (float16, bfloat16: what add-ons are published in). The networks hold
add-ons in the dtype in force, so float32 (the default --dtype) takes twice their files' bytes, and the defaults
double there: a ControlNet of SDXL (2.5 GB in 16 bits) or an IP-Adapter with the largest CLIP image encoder fits
its default memory in every dtype. A memory given explicitly is taken as it is.
"""

from __future__ import annotations

AUTO = "auto"  # a kind's default memory, sized for the dtype in force
DEFAULT_MB_16BIT = {"lora": 1024.0, "controlnet": 3072.0, "ip_adapter": 6144.0}  # ip_adapter: SDXL ViT-bigG ~4.2 GB
NAMES = {"lora": "LoRA adapters", "controlnet": "ControlNets", "ip_adapter": "IP-Adapters"}
WIDTHS = {"float32": 4, "float16": 2, "bfloat16": 2}


def default_mb(kind: str, dtype: str) -> float:
    """The default memory of `kind` ("lora", "controlnet", "ip_adapter") in MiB for networks of `dtype`."""
    return DEFAULT_MB_16BIT[kind] * WIDTHS.get(dtype, 4) / 2


def memory_mb(kind: str, value: float | str | None, dtype: str) -> float | None:
    """A kind's memory as configured: AUTO is its default for `dtype`; a number (MiB) or None (no bound) as it is.
    Anything else is a ValueError naming the setting and what it takes."""
    if value == AUTO:
        return default_mb(kind, dtype)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"{kind}_memory_mb: {value!r} is not a memory; allowed: a number of MiB >= 0, "
                     f"{AUTO!r} (the default for the dtype) or None (no bound)")


def default_help(kind: str) -> str:
    """The words --help gives a kind's default."""
    mb = DEFAULT_MB_16BIT[kind]
    return f"default: {mb:g} MB for 16-bit weights (--dtype float16/bfloat16), {2 * mb:g} MB for float32"

