"""The memory budget of an engine: what its device (or host) has free for batches."""

from __future__ import annotations

import os

from ..executor.base import Executor
from .requests import _device_of


def memory_budget(executor: Executor, share: float = 1.0) -> tuple[int, str]:
    """Bytes the executor's device has free for batches, and what they are; `share` of them when several engines
    share the device or host (each takes its share, not the whole).

    CUDA: free device memory (torch.cuda.mem_get_info) plus what torch's caching allocator holds reserved but
    unused. CPU: available host memory (MemAvailable in /proc/meminfo, else free pages from sysconf), and no more
    than the room left under this process's cgroup memory limit when one is set."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    budget, what = _free_bytes(executor)
    if share < 1:
        return int(budget * share), f"{what} ({share:.0%} share)"
    return budget, what


def _free_bytes(executor: Executor) -> tuple[int, str]:
    device = _device_of(executor)
    if getattr(device, "type", None) == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0)), f"free on {device}"
    available = _host_available_bytes()
    limit = _cgroup_room_bytes()
    if limit is not None and limit < available:
        return limit, "left under the cgroup memory limit"
    return available, "of available host memory"


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def _cgroup_room_bytes() -> int | None:
    """Bytes left under a cgroup v2 memory limit of this process, or None when there is none we can read."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            path = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current"), encoding="ascii") as f:
            current = int(f.read().strip())
        return max(int(limit) - current, 0)
    except (OSError, ValueError, IndexError, StopIteration):
        return None
