"""Where a run's logs go: all of it into one file per run, the console kept readable.

The stages log through Prefect's run loggers and the library through `logging` ("ppo_core.*",
"rlhf"); both reach the Prefect UI (the library loggers are Prefect "extra loggers", see
flows.runtime) at INFO. For `rlhf run`, every record at INFO or above also goes, traceback
included, to <work folder>/logs/run-<time>-<pid>.log. The console shows the same records
without tracebacks and without Prefect's own reports of a failed task or flow (each repeats the
message), because the CLI ends a failed run with one `error:` line naming that file; `--debug`
leaves the console as Prefect set it up.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from prefect.logging.formatters import PrefectFormatter

LIBRARY_LOGGERS = ("rlhf", "ppo_core")
FAILURE_REPORTERS = ("prefect.flow_runs", "prefect.task_runs")
FILE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s - %(message)s"
RUN_FORMATS = {  # Prefect's run records name their run, as on the console
    "flow_run_fmt": "%(asctime)s %(levelname)-7s flow run %(flow_run_name)r - %(message)s",
    "task_run_fmt": "%(asctime)s %(levelname)-7s task run %(task_run_name)r - %(message)s",
}


def library_logs_at_info() -> None:
    """The library's INFO records (dropped rows, progress) are kept, not just warnings."""
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)


class _WithoutTraceback(logging.Formatter):
    """Formats a record as `inner` does, minus its exception and stack text."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def _not_a_failure_report(record: logging.LogRecord) -> bool:
    if not record.name.startswith(FAILURE_REPORTERS):
        return True
    failed_state = record.getMessage().startswith(("Finished in state Failed", "Finished in state Crashed"))
    return record.levelno < logging.ERROR and not failed_state


def open_run_log(folder: Path, debug: bool) -> Path:
    """Start this process's run log in `folder` and quiet the console (unless `debug`). Prefect
    configures logging when imported, as it is here, before this extends it. Returns the path."""
    library_logs_at_info()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(PrefectFormatter(FILE_FORMAT, **RUN_FORMATS))
    root = logging.getLogger()
    root.addHandler(handler)
    logging.getLogger("prefect").setLevel(
        min(logging.getLogger("prefect").getEffectiveLevel(), logging.INFO)
    )
    if not debug:
        for console in [
            h for h in root.handlers if h is not handler and isinstance(h, logging.StreamHandler)
        ]:
            console.setFormatter(_WithoutTraceback(console.formatter))
            console.addFilter(_not_a_failure_report)
    return path


def one_line(exc: BaseException) -> str:
    """An exception as the one line the CLI prints: its type unless the message names it."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if getattr(exc, "names_itself", False):
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
