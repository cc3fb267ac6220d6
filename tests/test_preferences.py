"""Preference datasets: the three layouts, column mapping, bad rows, and the written set."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_core.data.config import DatasetPreferenceSource, PreferenceColumns
from ppo_core.data.preferences import (
    BadRowsError,
    PreferenceRow,
    load_preference_dataset,
    read_preference_set,
    write_preference_set,
)
from ppo_core.data.sources import split_hh
from tests.test_prompts import chat_tokenizer

HISTORY = "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Tell me a joke\n\nAssistant:"


def write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_hh_split_cuts_at_the_last_assistant_marker_not_inside_shared_answer_words() -> None:
    chosen = HISTORY + " Sure, why did the chicken cross the road?"
    rejected = HISTORY + " Sure, no."
    prompt, c, r = split_hh(chosen, rejected)
    assert prompt == HISTORY  # the common prefix runs on into " Sure, " but the prompt stops
    assert (c, r) == ("Sure, why did the chicken cross the road?", "Sure, no.")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_hh_layout_from_files(tmp_path: Path, suffix: str) -> None:
    rows = [
        {"chosen": HISTORY + " A good joke.", "rejected": HISTORY + " No."},
        {
            "chosen": "\n\nHuman: 2+2?\n\nAssistant: 4",
            "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5",
        },
    ]
    path = write_rows(tmp_path / f"hh{suffix}", rows)
    got, rejected, _ = load_preference_dataset(DatasetPreferenceSource(path=str(path)))
    assert rejected == {}
    assert [(r.prompt, r.chosen, r.rejected) for r in got] == [
        (HISTORY, "A good joke.", "No."),
        ("\n\nHuman: 2+2?\n\nAssistant:", "4", "5"),
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_explicit_layout_with_column_mapping_and_margin(tmp_path: Path, suffix: str) -> None:
    rows = [
        {"question": "q1", "good": "yes", "bad": "no", "strength": 2.5},
        {"question": "q2", "good": "fine", "bad": "awful", "strength": 0.5},
    ]
    path = write_rows(tmp_path / f"explicit{suffix}", rows)
    columns = PreferenceColumns(prompt="question", chosen="good", rejected="bad", margin="strength")
    source = DatasetPreferenceSource(path=str(path), columns=columns, layout="explicit")
    got, rejected, _ = load_preference_dataset(source)
    assert rejected == {}
    assert [(r.prompt, r.chosen, r.rejected, r.margin) for r in got] == [
        ("q1", "yes", "no", 2.5),
        ("q2", "fine", "awful", 0.5),
    ]
    assert got[1].metadata == {"source": str(path), "row": 2}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_conversational_rows_render_the_prompt_with_the_chat_template(
    tmp_path: Path, suffix: str
) -> None:
    tok = chat_tokenizer()
    system = {"role": "system", "content": "be kind"}
    user = {"role": "user", "content": "w1 w2"}
    rows = [
        {  # implicit prompt: the shared leading messages
            "chosen": [system, user, {"role": "assistant", "content": "w3"}],
            "rejected": [system, user, {"role": "assistant", "content": "w4"}],
        },
        {  # explicit prompt column with completions only
            "prompt": [user],
            "chosen": [{"role": "assistant", "content": "w5"}],
            "rejected": [{"role": "assistant", "content": "w6"}],
        },
    ]
    path = tmp_path / f"conv{suffix}"
    if suffix == ".jsonl":
        write_rows(path, rows)
    else:  # parquet needs one schema: give the first row a null prompt
        write_rows(path, [{"prompt": None, **rows[0]}, rows[1]])
    got, rejected, _ = load_preference_dataset(
        DatasetPreferenceSource(path=str(path)), tokenizer=tok
    )
    assert rejected == {}
    assert got[0].prompt == "<bos> system be kind <eos> <bos> user w1 w2 <eos> <bos> assistant "
    assert got[0].prompt == tok.apply_chat_template(
        [system, user], add_generation_prompt=True, tokenize=False
    )
    assert (got[0].chosen, got[0].rejected) == ("w3", "w4")
    assert got[1].prompt == "<bos> user w1 w2 <eos> <bos> assistant "
    assert (got[1].chosen, got[1].rejected) == ("w5", "w6")


def _bad_rows_file(path: Path, n_good: int) -> Path:
    lines = [
        json.dumps({"prompt": f"w{i % 10}", "chosen": "w1 w2", "rejected": "w3"}).encode()
        for i in range(n_good)
    ]
    lines += [
        json.dumps({"prompt": "w1", "chosen": "w2"}).encode(),  # missing_field
        json.dumps({"prompt": "w1", "chosen": "  ", "rejected": "w2"}).encode(),  # empty_text
        json.dumps({"prompt": "w1", "chosen": "w2 w3", "rejected": "w2 w3"}).encode(),  # identical
        b'{"prompt": "w1", "chosen": "caf\xe9", "rejected": "w2"}',  # latin-1 byte: invalid_utf8
        json.dumps(
            {"prompt": "w1", "chosen": " ".join(["w4"] * 50), "rejected": "w2"}
        ).encode(),  # too_long
        b"{not json",  # invalid_json
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_rows_are_skipped_and_counted_by_reason(tmp_path: Path) -> None:
    path = _bad_rows_file(tmp_path / "mixed.jsonl", n_good=94)
    source = DatasetPreferenceSource(path=str(path))
    rows, rejected, examples = load_preference_dataset(
        source, chat_tokenizer(), max_tokens=20, max_bad_fraction=0.1
    )
    assert len(rows) == 94
    assert rejected == {
        "missing_field": 1,
        "empty_text": 1,
        "identical": 1,
        "invalid_utf8": 1,
        "too_long": 1,
        "invalid_json": 1,
    }
    assert examples[0] == f"{path}:95: missing_field"
    assert f"{path}:98: invalid_utf8" in examples


def test_too_many_bad_rows_stop_with_file_and_rows_named(tmp_path: Path) -> None:
    path = _bad_rows_file(tmp_path / "mostly_bad.jsonl", n_good=4)
    source = DatasetPreferenceSource(path=str(path))
    with pytest.raises(BadRowsError) as err:
        load_preference_dataset(source, chat_tokenizer(), max_tokens=20, max_bad_fraction=0.1)
    message = str(err.value)
    assert "6 of 10 rows are bad" in message
    assert f"{path}:5: missing_field" in message and f"{path}:8: invalid_utf8" in message


def test_wrong_column_mapping_is_reported_not_silently_empty(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"q": "a", "c": "b", "r": "c"}] * 3)
    with pytest.raises(BadRowsError, match="missing_field"):
        load_preference_dataset(DatasetPreferenceSource(path=str(path), layout="explicit"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_preference_set_round_trip_and_content_hash(tmp_path: Path, fmt: str) -> None:
    rows = [
        PreferenceRow(prompt="p1", chosen="good", rejected="bad", metadata={"gold_chosen": 0.5}),
        PreferenceRow(prompt="p2", chosen="ünïcode ✓", rejected="plain", margin=1.5),
    ]
    path = tmp_path / f"set.{fmt}"
    info = write_preference_set(
        rows, path, fmt, rejected={"identical": 2}, examples=["f:3: identical"]
    )
    assert read_preference_set(path) == rows
    assert info.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (info.n_rows, info.n_read, info.rejected) == (2, 4, {"identical": 2})
    again = write_preference_set(rows, tmp_path / f"again.{fmt}", fmt)
    assert again.sha256 == info.sha256
    changed = write_preference_set(rows[:1], tmp_path / f"other.{fmt}", fmt)
    assert changed.sha256 != info.sha256
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
