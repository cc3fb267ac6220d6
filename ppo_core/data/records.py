"""Rows from the files users bring, one at a time, with a per-row error instead of a crash.

Local .jsonl/.json/.csv/.parquet files are read here rather than through `datasets`, because
`datasets` stops at the first undecodable line; we want every bad line counted and named
("file:row: reason") while the good ones go on. Dataset folders and hub ids go through
`datasets` (their rows are already decoded). Row numbers are 1-based: the line number for
JSONL, the data-row number for the other formats.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


@dataclass(frozen=True)
class Record:
    """One row: `data` when it could be read, else `error` (a short reason code)."""

    row: int
    data: dict[str, Any] | None = None
    error: str | None = None


def is_local_file(source: str) -> bool:
    return Path(source).expanduser().suffix.lower() in FILE_SUFFIXES


def read_records(source: str, split: str = "train", text_column: str = "text") -> Iterator[Record]:
    """Rows of a local file, a local dataset folder or a hub dataset id.

    A .txt file yields one row per non-empty line under `text_column`.
    """
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix in FILE_SUFFIXES and not path.is_file():
        raise FileNotFoundError(f"{source}: file not found")
    if suffix == ".jsonl":
        yield from _jsonl(path)
    elif suffix == ".json":
        yield from _json(path, split)
    elif suffix == ".csv":
        yield from _csv(path)
    elif suffix == ".parquet":
        yield from _parquet(path)
    elif suffix == ".txt":
        yield from _txt(path, text_column)
    else:
        yield from _datasets(source, split)


def _jsonl(path: Path) -> Iterator[Record]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield Record(number, error="invalid_utf8")
                continue
            yield _parsed(number, text)


def _parsed(number: int, text: str) -> Record:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return Record(number, error="invalid_json")
    if not isinstance(value, dict):
        return Record(number, error="invalid_json")
    return Record(number, data=value)


def _json(path: Path, split: str) -> Iterator[Record]:
    """A JSON array of objects, {split: [...]} / {"data": [...]}, or JSON lines named .json."""
    raw = path.read_bytes()
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        yield from _jsonl(path)  # JSON lines, or garbage: counted line by line
        return
    if isinstance(value, dict):
        value = value.get(split, value.get("data", [value]))
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected a JSON array of rows or {{{split!r}: [...]}}")
    for number, item in enumerate(value, start=1):
        if isinstance(item, dict):
            yield Record(number, data=item)
        elif isinstance(item, str):
            yield Record(number, data={"text": item})
        else:
            yield Record(number, error="invalid_json")


def _has_surrogates(text: str) -> bool:
    """surrogateescape maps undecodable bytes to lone surrogates U+DC80..U+DCFF."""
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def _csv(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8", errors="surrogateescape", newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=1):
            values = [v for v in row.values() if isinstance(v, str)]
            if any(_has_surrogates(v) for v in values):
                yield Record(number, error="invalid_utf8")
            else:
                yield Record(number, data=dict(row))


def _parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield _decoded(number, row)


def _decoded(number: int, row: dict[str, Any]) -> Record:
    """Binary columns hold raw bytes: decode them, or report the row as invalid UTF-8."""
    out = {}
    for key, value in row.items():
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                return Record(number, error="invalid_utf8")
        out[key] = value
    return Record(number, data=out)


def _txt(path: Path, column: str) -> Iterator[Record]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                yield Record(number, error="invalid_utf8")
                continue
            if text:
                yield Record(number, data={column: text})


def _datasets(source: str, split: str) -> Iterator[Record]:
    import datasets

    path = Path(source).expanduser()
    saved = path.is_dir() and any((path / n).exists() for n in ("dataset_dict.json", "state.json"))
    if saved:
        loaded = datasets.load_from_disk(str(path))
        table = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    else:
        table = datasets.load_dataset(source, split=split)
    for number, row in enumerate(table, start=1):
        yield _decoded(number, dict(row))
