"""Checkpoint files: a nested state dict written into a folder that exists complete or not at all.

Each checkpoint is written into a temporary sibling folder and renamed into place; the
`latest` pointer is then replaced with os.replace, which is atomic on POSIX. A crash at any
moment leaves the previous checkpoint as `latest`, and a half-written folder is never named.
Before the rename every file and the folder are fsynced, and the root after it (and after the
pointer's), so a power loss cannot publish a folder whose files were never written out. Reads
verify first: a checkpoint whose manifest is missing or disagrees with its files, or whose files
do not parse, raises CheckpointCorruptError naming the folder and the file; reading a root falls
back from `latest` to the newest intact checkpoint, with a warning, and says which it read.
This module knows files only; what a state holds is its owner's business (PPOTrainer.state_dict).

    ROOT/
      latest               the name of the newest complete checkpoint
      NAME/                one file per top-level entry KEY of the state:
        MANIFEST.json      {"format": 1, "files": {name: size in bytes}} for every other file
                           (sizes only: sha256 reads ~1.1 GB/s here, over a second per SmolLM2
                           checkpoint on every save and every load, for what sizes mostly catch)
        KEY.safetensors    a flat {str: Tensor} mapping (a module's state_dict); never pickled.
                           Tensors sharing one view (tied weights: SmolLM2's lm_head is its
                           embed_tokens) are stored once; the metadata's "aliases" (JSON,
                           {alias: stored key}) gives the other keys back on read, so
                           `module.load_state_dict(strict=True)` finds every key.
        KEY.json           an entry that JSON round-trips exactly (numbers, strings, lists, dicts)
        KEY.pt             anything else (optimizer states, RNG states, tuples): torch.save,
                           read back with weights_only=True, so loading executes no code
        dcp/               a sharded checkpoint's model and optimizer shards, listed in the
                           manifest like any file (ppo_core.lm.dcp_checkpoint writes and reads them)
      .NAME.tmp-*          a checkpoint being written (deleted on failure, renamed on success;
                           one a killed writer left is removed by folders.remove_debris)

A PPOTrainer checkpoint, for instance: policy.safetensors, value.safetensors (the critic or the
shared value head), optim.pt (optimizers, LR schedulers), rng.pt, trainer.json (iteration,
consecutive skips, KL controller).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ppo_core.lm.folders import fsync_path, replace_folder, temp_folder_for

LATEST = "latest"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
ALIASES = "aliases"
_KEY = re.compile(r"[A-Za-z0-9_-]+")
log = logging.getLogger(__name__)


class Checkpoint(NamedTuple):
    """What read_checkpoint read: which checkpoint folder, and the state in it."""

    folder: Path
    state: dict[str, Any]


class CheckpointCorruptError(ValueError):
    """A checkpoint (or every checkpoint of a root) is missing its manifest, has a file missing,
    of the wrong size, unlisted or unparseable; the message names the folder and the file."""


# ---- a nested state dict <-> files --------------------------------------------------
def checkpoint_name(iteration: int) -> str:
    """Zero-padded, so names sort in iteration order: pruning keeps the newest by name."""
    return f"iter-{iteration:06d}"


def write_checkpoint(root: str | Path, name: str, state: Mapping[str, Any], keep_last: int | None = 2) -> Path:
    """Write `state` as root/name (layout in the module docstring), atomically, point `latest`
    at it and keep the newest `keep_last` checkpoints. Raises CheckpointWriteError."""
    check_entry_names(state)
    start = time.perf_counter()
    with atomic_checkpoint(root, name, keep_last) as tmp:
        write_entries(tmp, state)
    final = Path(root) / name
    log.info("checkpoint %s: %.1f MB in %.1f s", final, _folder_bytes(final) / 1e6, time.perf_counter() - start)
    return final


def check_entry_names(state: Mapping[str, Any]) -> None:
    reserved = Path(MANIFEST).stem
    bad = [key for key in state if not (isinstance(key, str) and _KEY.fullmatch(key)) or key == reserved]
    if bad:
        raise ValueError(f"checkpoint entry names must match {_KEY.pattern} and not be {reserved}: {bad}")


def write_entries(folder: Path, state: Mapping[str, Any]) -> None:
    """One file per top-level entry, its format chosen by its value (module docstring)."""
    for key, value in state.items():
        if _is_tensor_map(value):
            save_tensors(folder / f"{key}.safetensors", value)
        elif _json_round_trips(value):
            save_json(folder / f"{key}.json", value)
        else:
            save_state(folder / f"{key}.pt", value)


def read_checkpoint(folder_or_root: str | Path, device: torch.device | str = "cpu") -> Checkpoint | None:
    """The checkpoint written by write_checkpoint, verified (module docstring), as (folder, state):
    from a checkpoint folder, or from a root: the checkpoint `latest` names or, when that one is
    corrupt, the other checkpoints newest first, each one skipped logged as a warning. None when
    there is none; CheckpointCorruptError when the folder, or every checkpoint of the root, is
    corrupt. Tensors of .safetensors entries are put on `device`; .pt entries stay on the CPU."""
    path = Path(folder_or_root)
    if not path.is_dir():
        return None
    if not _is_root(path):  # a checkpoint folder; one without files is no checkpoint
        has_files = (path / MANIFEST).is_file() or any(_is_state_file(p) for p in path.iterdir())
        return Checkpoint(path, _read_folder(path, device)) if has_files else None
    pointed = (path / LATEST).read_text().strip() if (path / LATEST).is_file() else None
    names = [d.name for d in _checkpoint_dirs(path)]
    if pointed is not None and pointed not in names:
        log.warning("%s names %s, which does not exist in %s; trying the others", LATEST, pointed, path)
    failures = []
    order = ([pointed] if pointed in names else []) + [n for n in reversed(names) if n != pointed]
    for name in order:
        try:
            return Checkpoint(path / name, _read_folder(path / name, device))
        except CheckpointCorruptError as err:
            log.warning("skipping corrupt checkpoint: %s", err)
            failures.append(str(err))
    if not failures:
        return None
    raise CheckpointCorruptError(f"no intact checkpoint in {path}; tried, in order: " + "; ".join(failures))


_STATE_SUFFIXES = (".safetensors", ".json", ".pt")


def _read_folder(folder: Path, device: torch.device | str) -> dict[str, Any]:
    """Verify the manifest, then parse every state file it lists."""
    state = {}
    for name in sorted(verify_checkpoint(folder)):
        path = folder / name
        if "/" in name or not _is_state_file(path):
            continue  # not a state entry (atomic_checkpoint takes any files)
        try:
            if path.suffix == ".safetensors":
                state[path.stem] = load_tensors(path, device)
            else:
                state[path.stem] = load_json(path) if path.suffix == ".json" else load_state(path)
        except (MemoryError, torch.OutOfMemoryError):
            raise  # the checkpoint is fine, the device is full
        except Exception as err:
            raise CheckpointCorruptError(
                f"checkpoint {folder}: {name} does not parse: {type(err).__name__}: {err}"
            ) from err
    return state


def verify_checkpoint(folder: str | Path) -> dict[str, int]:
    """The manifest of a checkpoint folder, {file: size}, after checking that it is there and
    parses, that every file it lists has its size and that no state file is missing from it
    (the contents are checked by parsing them). Raises CheckpointCorruptError."""
    folder = Path(folder)
    where = f"checkpoint {folder}"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise CheckpointCorruptError(f"{where}: {MANIFEST} is missing (an unfinished or pre-manifest write)")
    try:
        data = json.loads(manifest.read_text())
        if data["format"] != MANIFEST_FORMAT:
            raise ValueError(f"format {data['format']!r}, this version reads {MANIFEST_FORMAT}")
        sizes = {str(name): int(size) for name, size in data["files"].items()}
    except Exception as err:
        raise CheckpointCorruptError(f"{where}: {MANIFEST} does not parse: {type(err).__name__}: {err}") from err
    for name, expected in sorted(sizes.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointCorruptError(f"{where}: {name} is missing ({expected} bytes expected)")
        if (size := path.stat().st_size) != expected:
            raise CheckpointCorruptError(f"{where}: {name} has size {size} bytes, expected {expected}")
    unlisted = sorted(p.name for p in folder.iterdir() if _is_state_file(p) and p.name not in sizes)
    if unlisted:
        raise CheckpointCorruptError(f"{where}: {unlisted[0]} is not in {MANIFEST} (unlisted: {unlisted})")
    return sizes


def _is_state_file(path: Path) -> bool:
    return path.suffix in _STATE_SUFFIXES and path.name != MANIFEST and path.is_file()


def _is_intact(folder: Path) -> bool:
    try:
        verify_checkpoint(folder)
    except CheckpointCorruptError:
        return False
    return True


def _is_root(path: Path) -> bool:
    """A folder of checkpoints: it has `latest`, or a checkpoint folder with a manifest (the first
    checkpoint's pointer may not have been written)."""
    return (path / LATEST).is_file() or any((d / MANIFEST).is_file() for d in _checkpoint_dirs(path))


def _checkpoint_dirs(root: Path) -> list[Path]:
    """The published checkpoint folders of a root (not the dot-named temporary ones), by name."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


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
    """Yield a temporary folder to fill; on success it gets its manifest, is fsynced and becomes
    root/name, and root/latest names it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder_for(root / name)
    try:
        yield tmp
        _seal(tmp)
        replace_folder(tmp, root / name)  # re-saving a name swaps the old folder out whole
        _write_pointer(root, name)
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


def _seal(folder: Path) -> None:
    """Write the manifest of everything in `folder`, then fsync every file and folder in it,
    deepest first, so that the rename publishes contents that are on the disk."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)
    sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in files}
    save_json(folder / MANIFEST, {"format": MANIFEST_FORMAT, "files": sizes})
    for path in [*files, folder / MANIFEST]:
        fsync_path(path)
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        fsync_path(sub)
    fsync_path(folder)


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
    fd, tmp = tempfile.mkstemp(prefix=".latest.tmp-", dir=root)
    with os.fdopen(fd, "w") as handle:
        handle.write(name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` intact checkpoints (manifest and sizes agree), and
    the corrupt ones; `latest` always stays, and so does the newest intact checkpoint, the one
    a resume falls back to when `latest` is corrupt."""
    latest = latest_checkpoint(root)
    if latest is None:
        return
    folders = _checkpoint_dirs(Path(root))
    intact = [folder.name for folder in reversed(folders) if _is_intact(folder)]
    keep = {latest.name, *intact[: max(1, keep_last)]}
    for folder in folders:
        if folder.name not in keep:
            shutil.rmtree(folder, ignore_errors=True)


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
