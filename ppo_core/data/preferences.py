"""Preference pairs: the row schema, loading them from datasets, and the collected-set file.

A collected set is one local file (JSONL or parquet) plus a `PreferenceSetInfo`: its sha256
(the cache key of everything trained on it), how many rows were read, and how many were
skipped for which reason. Bad rows never crash a run; too many of them do, with a message
that names the file and the first bad rows, because a mostly-bad file is a wrong column
mapping or a wrong file, not noise.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field
from transformers import PreTrainedTokenizerBase

from ppo_core.data.config import DatasetPreferenceSource
from ppo_core.data.records import read_records
from ppo_core.data.sources import RowError, parse_margin, to_triple
from ppo_core.lm.checkpoint import sha256_file

MAX_EXAMPLES = 5


class PreferenceRow(BaseModel):
    """One comparison: `chosen` was preferred to `rejected` as an answer to `prompt`."""

    prompt: str
    chosen: str
    rejected: str
    margin: float | None = None
    """Optional preference strength, subtracted inside the Bradley-Terry loss."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free provenance: gold scores, labeler, source row."""


class PreferenceSetInfo(BaseModel):
    """A written preference set: where, which content, and what was left out."""

    path: str
    sha256: str
    n_rows: int
    n_read: int
    rejected: dict[str, int] = Field(default_factory=dict)
    """Skipped rows per reason (missing_field, empty_text, identical, invalid_utf8, too_long, ...)."""
    rejected_examples: list[str] = Field(default_factory=list)
    """The first few skipped rows as "file:row: reason"."""


class BadRowsError(ValueError):
    """More rows were bad than `max_bad_fraction` allows."""


def _token_count(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_row(
    prompt: str,
    chosen: str,
    rejected: str,
    tokenizer: PreTrainedTokenizerBase | None,
    max_tokens: int,
) -> None:
    """Raise RowError for a row that must not be trained on."""
    if not prompt.strip() or not chosen.strip() or not rejected.strip():
        raise RowError("empty_text")
    if chosen.strip() == rejected.strip():
        raise RowError("identical")
    if tokenizer is not None:
        response = max(_token_count(tokenizer, chosen), _token_count(tokenizer, rejected))
        if _token_count(tokenizer, prompt) + response > max_tokens:
            raise RowError("too_long")


def check_bad_fraction(
    where: str, n_read: int, rejected: dict[str, int], examples: list[str], max_bad_fraction: float
) -> None:
    n_bad = sum(rejected.values())
    if n_read == 0:
        raise BadRowsError(f"{where}: no rows read")
    if n_bad / n_read > max_bad_fraction:
        raise BadRowsError(
            f"{where}: {n_bad} of {n_read} rows are bad ({n_bad / n_read:.1%} > max_bad_fraction "
            f"{max_bad_fraction:.1%}); by reason {dict(rejected)}; first bad rows: "
            + "; ".join(examples)
        )


def load_preference_dataset(
    source: DatasetPreferenceSource,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_tokens: int = 512,
    max_bad_fraction: float = 0.1,
) -> tuple[list[PreferenceRow], dict[str, int], list[str]]:
    """Good rows, skipped-row counts by reason, and the first skipped rows as "file:row: reason".

    `tokenizer` renders conversational prompts (chat template) and measures length; without
    one the length check is skipped.
    """
    rows: list[PreferenceRow] = []
    rejected: Counter[str] = Counter()
    examples: list[str] = []
    n_read = 0
    for record in read_records(source.path, source.split):
        n_read += 1
        try:
            if record.error is not None:
                raise RowError(record.error)
            assert record.data is not None
            prompt, chosen, rejected_text = to_triple(
                record.data, source.columns, source.layout, tokenizer
            )
            check_row(prompt, chosen, rejected_text, tokenizer, max_tokens)
            margin = parse_margin(record.data, source.columns.margin)
        except RowError as err:
            rejected[err.reason] += 1
            if len(examples) < MAX_EXAMPLES:
                examples.append(f"{source.path}:{record.row}: {err.reason}")
            continue
        meta = {"source": source.path, "row": record.row}
        rows.append(
            PreferenceRow(
                prompt=prompt, chosen=chosen, rejected=rejected_text, margin=margin, metadata=meta
            )
        )
    check_bad_fraction(source.path, n_read, dict(rejected), examples, max_bad_fraction)
    return rows, dict(rejected), examples


def _atomic_target(path: Path) -> tuple[Path, Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    return Path(tmp), path


def write_preference_set(
    rows: list[PreferenceRow],
    path: str | Path,
    fmt: Literal["jsonl", "parquet"] = "jsonl",
    rejected: dict[str, int] | None = None,
    examples: list[str] | None = None,
) -> PreferenceSetInfo:
    """Write rows atomically (a crash never leaves a half file under `path`) and describe them.

    JSONL lines have sorted keys, so the same rows always give the same sha256.
    """
    tmp, final = _atomic_target(Path(path))
    try:
        if fmt == "jsonl":
            with tmp.open("w", encoding="utf-8") as handle:
                for row in rows:
                    handle.write(
                        json.dumps(row.model_dump(), ensure_ascii=False, sort_keys=True) + "\n"
                    )
        elif fmt == "parquet":
            import datasets

            records = [
                {
                    **row.model_dump(exclude={"metadata"}),
                    "metadata": json.dumps(row.metadata, sort_keys=True),
                }
                for row in rows
            ]
            datasets.Dataset.from_list(records).to_parquet(str(tmp))
        else:
            raise ValueError(f"unknown preference set format {fmt!r}")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    rejected = dict(rejected or {})
    return PreferenceSetInfo(
        path=str(final),
        sha256=sha256_file(final),
        n_rows=len(rows),
        n_read=len(rows) + sum(rejected.values()),
        rejected=rejected,
        rejected_examples=list(examples or []),
    )


def read_preference_set(path: str | Path) -> list[PreferenceRow]:
    """Rows of a set written by `write_preference_set` (format from the file suffix)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        out = []
        for item in pq.read_table(path).to_pylist():
            meta = item.pop("metadata", None)
            out.append(
                PreferenceRow(
                    **item, metadata=json.loads(meta) if isinstance(meta, str) else meta or {}
                )
            )
        return out
    with path.open(encoding="utf-8") as handle:
        return [PreferenceRow.model_validate_json(line) for line in handle if line.strip()]
