"""One run per work folder, one creator per tracking database: advisory file locks.

`flock` locks belong to the open file, so the kernel releases them when the holder exits or is
killed: a stale lock of a dead run is simply taken over by the next one. The work-folder lock
file also records who holds it, for the message a second run prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WORK_LOCK = ".run.lock"
_held: dict[Path, int] = {}  # lock files this process holds -> nesting depth
_previous: dict[Path, dict] = {}  # what a killed holder left in a lock file this process took over


class WorkFolderBusy(RuntimeError):
    """Another live process is running a pipeline in the same work folder."""


@contextmanager
def work_folder_lock(work_dir: str | Path) -> Iterator[None]:
    """Hold the work folder for this process (re-entrant: the CLI takes it before Prefect starts,
    the flow again inside); raise WorkFolderBusy naming the holder when another process has it."""
    path = (Path(work_dir) / WORK_LOCK).resolve()
    if path in _held:
        _held[path] += 1
        try:
            yield
        finally:
            _held[path] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkFolderBusy(f"work folder {path.parent} is in use by {_holder(path)}; "
                                 "wait for that run to finish or set orchestration.work_dir") from None
        left = os.pread(fd, 1 << 16, 0)
        if left.strip():  # a holder that ended normally clears the file: this one was killed
            with contextlib.suppress(ValueError):
                _previous[path] = json.loads(left)
        _write_holder(fd)
        _held[path] = 1
        try:
            yield
        finally:
            del _held[path]
            _previous.pop(path, None)
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock


def _write_holder(fd: int) -> None:
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:200]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


def record_holder(work_dir: str | Path, **fields: str) -> dict | None:
    """Add `fields` (e.g. the Prefect flow run id) to the held lock's holder record and return
    the record a killed earlier holder left behind, if the lock was taken over from one."""
    path = (Path(work_dir) / WORK_LOCK).resolve()
    if path not in _held:
        raise RuntimeError(f"{path}: record_holder outside work_folder_lock")
    current = json.loads(path.read_text() or "{}")
    with path.open("r+") as handle:
        handle.truncate(0)
        handle.write(json.dumps({**current, **fields}))
    return _previous.get(path)


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on {info['host']} since {info['since']} ({info['command']})"
    except (OSError, ValueError, KeyError):
        return "another process"


@contextmanager
def creation_lock(target: str | Path) -> Iterator[None]:
    """Wait for, then hold, the lock that serialises creating `target` (e.g. a sqlite store)."""
    path = Path(f"{target}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
