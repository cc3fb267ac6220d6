"""Checkpoint files: a nested state dict written into a folder that exists complete or not at all.

Each checkpoint is written into a temporary sibling folder and renamed into place; the
`latest` pointer is then replaced with os.replace, which is atomic on POSIX. A crash at any
moment leaves the previous checkpoint as `latest`, and a half-written folder is never named.
This module knows files only; what a state holds is its owner's business (PPOTrainer.state_dict).

    ROOT/
      latest               the name of the newest complete checkpoint
      NAME/                one file per top-level entry KEY of the state:
        KEY.safetensors    a flat {str: Tensor} mapping (a module's state_dict); never pickled.
                           Tensors sharing one view (tied weights: SmolLM2's lm_head is its
                           embed_tokens) are stored once; the metadata's "aliases" (JSON,
                           {alias: stored key}) gives the other keys back on read, so
                           `module.load_state_dict(strict=True)` finds every key.
        KEY.json           an entry that JSON round-trips exactly (numbers, strings, lists, dicts)
        KEY.pt             anything else (optimizer states, RNG states, tuples): torch.save,
                           read back with weights_only=True, so loading executes no code
      .NAME.tmp-*          a checkpoint being written (deleted on failure, renamed on success)

A PPOTrainer checkpoint, for instance: policy.safetensors, value.safetensors (the critic or the
shared value head), optim.pt (optimizers, LR schedulers), rng.pt, trainer.json (iteration,
consecutive skips, KL controller).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LATEST = "latest"
ALIASES = "aliases"
_KEY = re.compile(r"[A-Za-z0-9_-]+")


# ---- a nested state dict <-> files --------------------------------------------------
def checkpoint_name(iteration: int) -> str:
    """Zero-padded, so names sort in iteration order: pruning keeps the newest by name."""
    return f"iter-{iteration:06d}"


def write_checkpoint(root: str | Path, name: str, state: Mapping[str, Any], keep_last: int | None = 2) -> Path:
    """Write `state` as root/name (layout in the module docstring), atomically, point `latest`
    at it and keep the newest `keep_last` checkpoints. Raises CheckpointWriteError."""
    bad = [key for key in state if not (isinstance(key, str) and _KEY.fullmatch(key))]
    if bad:
        raise ValueError(f"checkpoint entry names must match {_KEY.pattern}: {bad}")
    with atomic_checkpoint(root, name, keep_last) as tmp:
        for key, value in state.items():
            if _is_tensor_map(value):
                save_tensors(tmp / f"{key}.safetensors", value)
            elif _json_round_trips(value):
                save_json(tmp / f"{key}.json", value)
            else:
                save_state(tmp / f"{key}.pt", value)
    return Path(root) / name


def read_checkpoint(folder_or_root: str | Path, device: torch.device | str = "cpu") -> dict[str, Any] | None:
    """The state written by write_checkpoint, from a checkpoint folder or from a root (the
    checkpoint `latest` names); None when there is none. Tensors of .safetensors entries are put
    on `device`; .pt entries stay on the CPU (RNG states must)."""
    folder = Path(folder_or_root)
    if (folder / LATEST).exists():
        folder = latest_checkpoint(folder)
        if folder is None:
            return None
    readers = {".safetensors": lambda path: load_tensors(path, device), ".json": load_json, ".pt": load_state}
    files = sorted(p for p in folder.glob("*") if p.is_file() and p.suffix in readers) if folder.is_dir() else []
    return {path.stem: readers[path.suffix](path) for path in files} or None


def _is_tensor_map(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and len(value) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def _json_round_trips(value: Any) -> bool:
    """True when JSON gives back an equal value: no tensors, tuples or non-string keys."""
    try:
        return json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        return False


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """safetensors refuses tensors that share storage: each shared view is stored once under
    its first key and the others are recorded as aliases; any other tensor that is not alone and
    whole in its storage is copied."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for key, tensor in tensors.items():
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        view = (*storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if tensor.numel() and view in views:
            aliases[key] = views[view]
            continue
        whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        if tensor.numel() and (not whole or storage in storages):
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        else:
            storages.add(storage)
        views[view] = key
        stored[key] = tensor
    metadata = {"format": "pt"} | ({ALIASES: json.dumps(aliases, sort_keys=True)} if aliases else {})
    save_file(stored, str(path), metadata=metadata)


def load_tensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A file written by save_tensors, alias keys included (they share the stored tensor)."""
    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
        aliases = json.loads((handle.metadata() or {}).get(ALIASES, "{}"))
    for alias, key in aliases.items():
        tensors[alias] = tensors[key]
    return tensors


def save_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def save_state(path: Path, state: Any) -> None:
    torch.save(state, path)


def load_state(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


# ---- atomic folders, `latest`, pruning ---------------------------------------------
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


# ---- content hashes ----------------------------------------------------------------
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
