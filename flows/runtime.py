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
    # oneDNN (torch's bf16 matmuls on a CPU) keeps up to 1,024 compiled primitives, one per
    # shape: generation's growing lengths and the stages' batch shapes fill it, and its entries,
    # long-lived and scattered, keep the heap from reusing freed blocks (tests/bench/README.md,
    # "oneDNN's primitive cache"). At 128 a PPO iteration ran within 2 % of its time there.
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128",
    "GIT_PYTHON_REFRESH": "quiet",
}


def configure_environment(work_dir: str | Path = ".rlhf") -> None:
    """Set the defaults above (a value already in the environment wins)."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    home = Path(os.environ.setdefault("PREFECT_HOME", str(Path(work_dir).resolve() / "prefect")))
    home.mkdir(parents=True, exist_ok=True)  # Prefect creates only the last level


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
GLIBC_MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def configure_heap() -> None:
    """Keep freed memory in glibc's heap for the next allocations, and hand it back only at the
    boundaries `release_free_heap` marks (after every PPO iteration and every stage). No block
    gets its own mapping and the heap's top is never trimmed on a free: a freshly mapped page is
    zero-filled by the kernel on first touch, and a PPO step makes and frees gigabytes of tensors
    (logits, gradients, the fp32 master gradients). The price is some spread of the heap at the
    update's peak (tests/bench/README.md, "The heap kept for reuse"). Left alone where the
    environment sets glibc's malloc (MALLOC_*_ or GLIBC_TUNABLES); a no-op without glibc."""
    if any(k in os.environ for k in GLIBC_MALLOC_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_MAX, 0)  # man mallopt: 0 disables mmap for large requests
        libc.mallopt(M_TRIM_THRESHOLD, -1)  # -1 disables trimming completely


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim) after a stage and after
    every PPO iteration: the models a finished stage dropped, or the tensors an iteration freed,
    otherwise stay in the process's resident memory (`configure_heap` keeps them for reuse) and
    add to what comes next's peak. A no-op where there is no glibc."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
