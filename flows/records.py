"""Where stage results are cached: JSON records of the typed stage references, never pickles.

Prefect persists each stage's result as a record file named by the stage's cache key and, when
it reads one back (to answer "is this stage cached?" as well as to load it), decodes it with
whatever serializer the record itself names, pickle included. Anyone who can write to the work
folder could then run code in the next `rlhf run` or `rlhf stages`. So the stages write JSON
records (`RECORD_SERIALIZER`), and `RecordStorage` hands Prefect only records that are exactly
that: JSON whose objects are our own result models (`flows.refs`). Anything else reads as
"no such record", so the stage simply runs again and overwrites it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import LocalFileSystem
from prefect.serializers import JSONSerializer

from flows import refs

RECORD_SERIALIZER = JSONSerializer()


def _stage_results(cls: type = refs.StageRef) -> set[str]:
    """Qualified names of every stage result model (StageRef and its subclasses)."""
    return {f"{cls.__module__}.{cls.__qualname__}"}.union(*(_stage_results(sub) for sub in cls.__subclasses__()))


ALLOWED_CLASSES = frozenset(_stage_results())
log = logging.getLogger("rlhf")


class UntrustedRecordError(ValueError):
    """A cached-result record that was not written by these stages (or was altered)."""


def check_record(content: bytes, name: str) -> bytes:
    """`content` unchanged when it is a JSON record of allowed classes; else UntrustedRecordError."""
    try:
        record = json.loads(content)
        serializer = record["metadata"]["serializer"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UntrustedRecordError(f"cache record {name}: not a JSON result record ({exc})") from None
    if serializer != RECORD_SERIALIZER.model_dump(mode="json"):
        kind = serializer.get("type") if isinstance(serializer, dict) else serializer
        raise UntrustedRecordError(f"cache record {name}: serializer {kind!r} is not rlhf's JSON serializer")
    try:
        result = json.loads(record["result"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UntrustedRecordError(f"cache record {name}: its result is not JSON ({exc})") from None
    foreign = sorted(_class_names(result) - ALLOWED_CLASSES)
    if foreign:
        raise UntrustedRecordError(f"cache record {name}: names classes {foreign} that are not stage results")
    return content


def _class_names(value: Any) -> set[str]:
    """Every `__class__` / `__exc_type__` that Prefect's JSON decoder would import."""
    if isinstance(value, list):
        return set().union(*(_class_names(v) for v in value)) if value else set()
    if not isinstance(value, dict):
        return set()
    own = {str(value[k]) for k in ("__class__", "__exc_type__") if k in value}
    return own.union(*(_class_names(v) for v in value.values()))


class RecordStorage(LocalFileSystem):
    """A local result folder that refuses records `check_record` does not trust (logged, and
    to Prefect the record does not exist)."""

    _block_type_name = "RLHF stage records"

    @classmethod
    def for_folder(cls, folder: Path) -> RecordStorage:
        """The storage of one work folder, saved as a block (Prefect accepts only saved blocks
        as a task's result storage), named by a hash of the folder's path."""
        storage = cls(basepath=str(folder))
        digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
        storage.save(f"rlhf-records-{digest}", overwrite=True)
        return storage

    async def aread_path(self, path: str) -> bytes:
        return _checked(await super().aread_path(path), path)

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return _checked(LocalFileSystem.read_path(self, path, _sync=True), path)


def _checked(content: bytes, path: str) -> bytes:
    try:
        return check_record(content, path)
    except UntrustedRecordError as exc:
        log.warning("%s; ignoring it, the stage runs again", exc)
        raise
