"""Process-wide defaults that must be in place before prefect or mlflow is imported.

Offline and quiet: no telemetry from either tool, Prefect's home (its sqlite database for the
ephemeral API) inside the working folder, and a generous start-up timeout for the ephemeral
API (its first database migration on a fresh machine can take a minute).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from pathlib import Path

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_CLIENT_ENABLE_METRICS": "false",
    "DO_NOT_TRACK": "1",
    "MLFLOW_ENABLE_TELEMETRY": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # INFO reaches the Prefect UI; the library's loggers go there too (flows.logs)
    "PREFECT_LOGGING_LEVEL": "INFO",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "rlhf,ppo_core",
    # library code also logs outside runs (torchrun workers, notebooks): no warning for each
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "TOKENIZERS_PARALLELISM": "false",
    "GIT_PYTHON_REFRESH": "quiet",
}


def configure_environment(work_dir: str | Path = ".rlhf") -> None:
    """Set the defaults above (a value already in the environment wins)."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    home = Path(os.environ.setdefault("PREFECT_HOME", str(Path(work_dir).resolve() / "prefect")))
    home.mkdir(parents=True, exist_ok=True)  # Prefect creates only the last level


MMAP_THRESHOLD = 1024 * 1024
"""Blocks from this size up get their own mapping, handed back to the OS when freed (glibc's
M_MMAP_THRESHOLD, fixed at its initial value). Not lower: every fresh mapping is zero-filled page
by page on first touch, and SmolLM2's weight-sized blocks (its bf16 576x576 projections, 648 KiB)
are made and freed at every step; at 128 or 512 KiB a bf16 PPO iteration spent 20-30 s in the
kernel and ran ~60 % slower (tests/bench/README.md, "Heap retention"). What the heap keeps of
the smaller blocks `release_free_heap` hands back after every PPO iteration."""
M_MMAP_THRESHOLD = -3  # malloc.h


def bound_heap_retention() -> None:
    """Fix glibc's mmap threshold for this process (unless MALLOC_MMAP_THRESHOLD_ set one at its
    start). Left dynamic, glibc raises the threshold to the size of every mapped block freed, up
    to 32 MiB: from then on tensors up to that size are carved from the heap, and the pages of the
    freed ones stay resident. A bf16 PPO round grew its RSS by ~600 MB over 8 iterations that way
    (tests/bench/README.md, "Heap retention"). A no-op where there is no glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim) after a stage and after
    every PPO iteration: the models a finished stage dropped, or the heap-sized blocks an iteration
    freed, otherwise stay in the process's resident memory and add to what comes next's peak. A
    no-op where there is no glibc."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
