"""Sharded checkpoints: torch.distributed.checkpoint (DCP) files in the atomic checkpoint folders of
ppo_core.lm.checkpoint, written by every rank of a sharded run, readable by any number of ranks
or by one process (DCP reshards on load: export, registration, a 1-process resume).

    ROOT/NAME/
      MANIFEST.json        every file below with its size, the DCP files included, so a torn or
                           truncated shard makes the checkpoint corrupt (and a resume falls back)
      dcp/.metadata        DCP's index: which file holds which piece of which tensor
      dcp/__R_0.distcp     rank R's shards: tensors only (model and optimizer states)
      KEY.json, KEY.pt     the small entries, written by rank 0 as in any checkpoint

Writing: rank 0 creates the temporary folder and broadcasts its name; every rank writes its
shards into it (dcp.save, which fsyncs them and fails on every rank if one fails); rank 0 writes
the small entries; after the ranks have agreed that all of it was written, rank 0 seals the
folder (manifest, fsync), renames it into place, points `latest` at it and prunes, and broadcasts
the outcome, so every rank returns, or raises CheckpointWriteError, together.

Reading never executes code from the files: the DCP index is unpickled with an allow-list of
DCP's own metadata classes (DCP itself uses a full unpickler), shards are read by DCP with
torch.load(weights_only=True), and only tensors are ever stored in DCP (its non-tensor values would
be read with a full unpickler), the rest going to the small entries.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ppo_core.lm.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointWriteError,
    _folder_bytes,
    _seal,
    _write_failure,
    _write_pointer,
    check_entry_names,
    prune_checkpoints,
    read_checkpoint,
    write_entries,
)
from ppo_core.lm.folders import replace_folder, temp_folder_for

DCP_DIR = "dcp"
log = logging.getLogger(__name__)


def _broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _failed_anywhere(error: str | None) -> str | None:
    """The first rank's error, on every rank; None when no rank failed."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def _only_tensors(state: Mapping[str, Any], where: str = "") -> None:
    for key, value in state.items():
        if isinstance(value, Mapping):
            _only_tensors(value, f"{where}{key}.")
        elif not isinstance(value, torch.Tensor):
            raise TypeError(f"sharded checkpoint entry {where}{key} is a {type(value).__name__}: DCP holds tensors only")


def write_sharded_checkpoint(
    root: str | Path, name: str, sharded: Mapping[str, Any], entries: Mapping[str, Any], keep_last: int | None = 2
) -> Path:
    """Write root/name on every rank of the default process group (layout and protocol in the
    module docstring): `sharded` (nested dicts of tensors, DTensors sharded over the ranks) with
    DCP, `entries` (rank 0's; ppo_core.lm.checkpoint formats) as files. Raises CheckpointWriteError
    on every rank when any part failed; the previous checkpoint is then still `latest`."""
    _only_tensors(sharded)
    check_entry_names(entries)
    root, main, start = Path(root), dist.get_rank() == 0, time.perf_counter()
    tmp, error = None, None
    if main:
        try:
            tmp = str(temp_folder_for(root / name))  # creates root
        except Exception as err:
            error = f"could not write checkpoint {name} in {root}: {type(err).__name__}: {err}"
    tmp, error = _broadcast((tmp, error))
    if error is not None:
        raise CheckpointWriteError(error)
    tmp = Path(tmp)
    try:
        dcp.save(sharded, storage_writer=FileSystemWriter(tmp / DCP_DIR, sync_files=True))
        if main:
            write_entries(tmp, entries)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    error = _failed_anywhere(error)
    if main:
        try:
            if error is not None:
                raise RuntimeError(error)
            _seal(tmp)
            replace_folder(tmp, root / name)
            _write_pointer(root, name)
        except Exception as err:
            error = _write_failure(root, name, _folder_bytes(tmp) if tmp.exists() else 0, err)
            shutil.rmtree(tmp, ignore_errors=True)
    error = _broadcast(error)
    if error is not None:
        raise CheckpointWriteError(error)
    if main and keep_last is not None:
        prune_checkpoints(root, keep_last)
    dist.barrier()  # every rank sees the published folder (and no pruned one) before it goes on
    final = root / name
    if main:
        log.info("checkpoint %s: %.1f MB in %.1f s", final, _folder_bytes(final) / 1e6, time.perf_counter() - start)
    return final


def is_sharded_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / DCP_DIR / ".metadata").is_file()


def read_agreed_checkpoint(folder_or_root: str | Path, device: torch.device | str = "cpu") -> Checkpoint | None:
    """read_checkpoint, with every rank reading the checkpoint rank 0 chose (rank 0 alone decides
    whether `latest` is intact and which one to fall back to); one process: read_checkpoint."""
    if not dist.is_initialized():
        return read_checkpoint(folder_or_root, device)
    found, message = None, None
    if dist.get_rank() == 0:
        try:
            found = read_checkpoint(folder_or_root, device)
        except Exception as err:
            message = f"{type(err).__name__}: {err}"
            if dist.get_world_size() == 1:
                raise
            _broadcast((None, message))
            raise
    chosen, message = _broadcast((None if found is None else str(found.folder), message))
    if message is not None:
        raise RuntimeError(f"rank 0 could not read a checkpoint of {folder_or_root}: {message}")
    if dist.get_rank() == 0 or chosen is None:
        return found
    return read_checkpoint(chosen, device)


def load_sharded(folder: str | Path, target: dict[str, Any]) -> None:
    """Fill `target` (nested dicts of tensors, DTensors where the reader is sharded) in place from a
    checkpoint's DCP files, resharding as needed; every rank of the group calls it, or one process
    without a group."""
    _only_tensors(target)
    reader = _SafeReader(Path(folder) / DCP_DIR)
    try:
        reader.read_metadata()
    except Exception as err:
        raise CheckpointCorruptError(f"checkpoint {folder}: {DCP_DIR}/.metadata does not parse: {err}") from err
    dcp.load(target, storage_reader=reader, no_dist=not dist.is_initialized())


# ---- DCP's index without a full unpickler ---------------------------------------------
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which a checkpoint index never holds")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
