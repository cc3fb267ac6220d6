"""Atomic checkpoints: a checkpoint folder either exists complete or not at all.

Each checkpoint is written into a temporary sibling folder and renamed into place; the
`latest` pointer is then replaced with os.replace, which is atomic on POSIX. A crash at any
moment leaves the previous checkpoint as `latest`, and a half-written folder is never named.
Weights are safetensors; other state is JSON or torch.save read back with weights_only=True.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"


@contextmanager
def atomic_checkpoint(root: str | Path, name: str, keep_last: int | None = 2) -> Iterator[Path]:
    """Yield a temporary folder to fill; on success it becomes root/name and root/latest names it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        yield tmp
        final = root / name
        trash = None
        if final.exists():  # re-saving the same name: move the old one aside, delete it last
            trash = root / f".{name}.old-{os.getpid()}"
            os.replace(final, trash)
        os.replace(tmp, final)
        _write_pointer(root, name)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except Exception as err:
        written = _folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(_write_failure(root, name, written, err)) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        prune_checkpoints(root, keep_last)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one is still complete and `latest`."""


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _write_failure(root: Path, name: str, written: int, err: Exception) -> str:
    """Why a write failed, in terms a user can act on: a full disk shows up from torch.save as
    'unexpected pos ...' or 'iostream error', so the free space is always stated."""
    free = shutil.disk_usage(root).free
    previous = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
    kept = f"the last complete checkpoint ({previous}) is intact" if previous else "no earlier checkpoint exists"
    return (
        f"could not write checkpoint {name} in {root}: {type(err).__name__}: {err}. "
        f"{free / 2**30:.2f} GiB free on that disk ({written / 2**30:.2f} GiB of this checkpoint "
        f"were written before the failure); {kept}. Free space and rerun to resume."
    )


def _write_pointer(root: Path, name: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".latest.", dir=root)
    with os.fdopen(fd, "w") as handle:
        handle.write(name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, root / LATEST)


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints; `latest` always stays."""
    latest = latest_checkpoint(root)
    if latest is None:
        return
    root = Path(root)
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for old in names[: max(0, len(names) - keep_last)]:
        if old != latest.name:
            shutil.rmtree(root / old, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder `latest` points to, or None when there is no complete checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    folder = Path(root) / pointer.read_text().strip()
    return folder if folder.is_dir() else None


def save_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def save_state(path: Path, state: Any) -> None:
    torch.save(state, path)


def load_state(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Content hash of one file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_tree(folder: str | Path, pattern: str = "*.safetensors") -> str:
    """Hash of the weight files in a folder (names and contents), stable across machines."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob(pattern)):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()
