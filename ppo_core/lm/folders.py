"""Folders written aside and swapped into place, so a reader (or the next run after a crash)
finds the old folder or the new one, whole, and never neither.

Temporary names carry a tag and the writer's pid (`.NAME.tmp-*`, `.NAME.old-*`); what a killed
writer left behind is removed by `remove_debris` once no writer can be running (the caller
holds the folder's lock).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from pathlib import Path

DEBRIS_PATTERNS = (".*.tmp-*", ".*.old-*")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h: swap two names in one step


def fsync_path(path: Path) -> None:
    """Flush a file's contents, or a folder's entries (the names of what it holds), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_folder_for(final: Path) -> Path:
    """A new empty folder beside `final`, named for it and unique to this writer."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` atomically (Linux renameat2); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # a filesystem without exchange
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def replace_folder(new: Path, final: Path) -> Path:
    """Make `new` (a finished folder beside `final`) be `final`; an existing `final` is swapped
    out in the same step and then deleted. Without an atomic exchange, the old folder is
    renamed aside first, and a crash between the two renames leaves it there under `.old-`."""
    if not final.exists():
        os.replace(new, final)
    elif _exchange(new, final):
        shutil.rmtree(new)  # `new` is now the old contents
    else:
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(new, final)
        shutil.rmtree(old)
    fsync_path(final.parent)
    return final


def remove_debris(root: Path) -> list[Path]:
    """Delete the temporary folders and files that killed writers left anywhere under `root`;
    returns what was removed. Call only while no writer can be running there."""
    found = sorted(
        {p for pattern in DEBRIS_PATTERNS for p in Path(root).rglob(pattern)},
        key=lambda p: len(p.parts),
    )
    removed: list[Path] = []
    for path in found:
        if any(parent in removed for parent in path.parents):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed
