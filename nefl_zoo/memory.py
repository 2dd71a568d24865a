"""Refuse a batch that cannot fit in memory before allocating it.

A batch of a billion images is refused at once with the bound it breaks, instead of the
process being killed by the kernel (Linux overcommits, so the allocation itself often
"succeeds"). The estimate per sample is :data:`WORKING_SET_FACTOR` times the largest working
set of one operation (its inputs plus outputs): a forward pass holds a few such tensors at once
(a residual's shortcut, a convolution's workspace; measured 1-3x on the zoo's ResNets), so a
batch that passes may still be tight, but one that fails does not fit. Standard library only
(the torch-free runtime uses it).
"""

from __future__ import annotations

import os
from pathlib import Path

WORKING_SET_FACTOR = 4


def available_memory_bytes() -> int | None:
    """Memory this process may still use: the kernel's ``MemAvailable``, capped by a cgroup
    (v2) limit; ``None`` when neither is known (the check is then skipped)."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    if not limits:
        try:
            limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, OSError, ValueError):
            pass
    try:
        cgroup = Path("/sys/fs/cgroup")
        maximum = (cgroup / "memory.max").read_text().strip()
        if maximum.isdigit():
            limits.append(int(maximum) - int((cgroup / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        pass
    return max(0, min(limits)) if limits else None


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} PiB"


def check_batch_memory(batch: int, bytes_per_sample: float, fixed_bytes: float = 0, what: str = "") -> None:
    """``ValueError`` when ``fixed_bytes + batch * bytes_per_sample`` (an estimate: see the
    module docstring) exceeds the memory available, naming the batch, the estimate and the
    largest batch that fits; ``what`` says what was estimated."""
    available = available_memory_bytes()
    need = fixed_bytes + batch * bytes_per_sample
    if available is None or need <= available:
        return
    largest = int(max(0, available - fixed_bytes) // bytes_per_sample) if bytes_per_sample > 0 else 0
    detail = f" ({what})" if what else ""
    raise ValueError(
        f"batch {batch}: needs about {_size(need)}{detail}, more than the {_size(available)} of memory "
        f"available; use a batch of at most {largest:,}"
    )


__all__ = ["WORKING_SET_FACTOR", "available_memory_bytes", "check_batch_memory"]
