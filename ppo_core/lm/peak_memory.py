"""Peak memory of a stretch of work in this process: the resident-set high-water mark (Linux
VmHWM, which writing "5" to /proc/self/clear_refs resets to the current RSS) and, where CUDA is
in use, the caching allocator's peak of allocated bytes.

One reset point per process at a time: a `PeakMemory` started inside another resets the outer
one's high-water mark too (the kernel keeps one per process).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

MIB = 2**20


def _status_bytes(key: str) -> int | None:
    try:
        found = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def reset_rss_peak() -> bool:
    """VmHWM := VmRSS; False where the kernel offers no reset (not Linux, or before 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def rss_bytes() -> int | None:
    return _status_bytes("VmRSS")


def rss_peak_bytes() -> int | None:
    return _status_bytes("VmHWM")


class PeakMemory:
    """Peaks since `start()`, in MiB: {"peak_rss_mib": ..., "peak_cuda_mib": ...} (each only
    where it can be measured; the CUDA one only once CUDA has been initialised)."""

    def __init__(self) -> None:
        self.rss_resettable = False

    def start(self) -> PeakMemory:
        self.rss_resettable = reset_rss_peak()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        return self

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        peak = rss_peak_bytes()
        if self.rss_resettable and peak is not None:
            out["peak_rss_mib"] = peak / MIB
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / MIB
        return out
