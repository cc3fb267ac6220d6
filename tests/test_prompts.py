"""Prompts: loading from every supported file shape, the hash split, chat-template encoding."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ppo_core.data.config import PromptConfig
from ppo_core.data.prompts import builtin_path, encode_prompts, load_prompts, split_prompts

CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> assistant {% endif %}"
)


def chat_tokenizer(template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    words = ["<pad>", "<eos>", "<bos>", "<unk>", "system", "user", "assistant", "be", "kind"]
    words += [f"w{i}" for i in range(10)]
    backend = Tokenizer(
        models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    tok.chat_template = template
    return tok


def test_builtin_prompt_set_is_large_distinct_and_short() -> None:
    prompts = load_prompts(PromptConfig(source="builtin:default"))
    assert builtin_path("default").parent.name == "data"
    assert builtin_path("default").parent.parent.name == "ppo_core"  # library data, not flows'
    assert len(prompts) >= 300
    assert len(set(prompts)) == len(prompts)
    assert max(len(p.split()) for p in prompts) <= 20
    text = " ".join(prompts).lower()
    for topic in ("review", "restaurant", "film", "hotel", "book", "commute", "weather", "meeting"):
        assert topic in text, topic


def test_max_prompts_and_unknown_builtin() -> None:
    assert len(load_prompts(PromptConfig(source="builtin:default", max_prompts=7))) == 7
    with pytest.raises(FileNotFoundError, match="builtin:nope"):
        load_prompts(PromptConfig(source="builtin:nope"))


def _write(path: Path, rows: list[dict]) -> Path:
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_load_prompts_from_files_with_column_mapping(tmp_path: Path, suffix: str) -> None:
    rows = [
        {"question": "first?", "other": "x"},
        {"question": "second?", "other": "y"},
        {"question": "first?", "other": "dup"},
        {"question": "", "other": "empty"},
    ]
    path = _write(tmp_path / f"prompts{suffix}", rows)
    assert load_prompts(PromptConfig(source=str(path), column="question")) == ["first?", "second?"]


def test_load_prompts_from_txt_and_json_strings(tmp_path: Path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\n  two  \none\n")
    assert load_prompts(PromptConfig(source=str(txt))) == ["one", "two"]
    plain = tmp_path / "p.json"
    plain.write_text(json.dumps(["a", "b"]))
    assert load_prompts(PromptConfig(source=str(plain))) == ["a", "b"]


def test_split_is_deterministic_near_fraction_and_stable_under_additions() -> None:
    prompts = [f"prompt number {i}" for i in range(2000)]
    train, held = split_prompts(prompts, 0.2)
    assert len(train) + len(held) == 2000 and not set(train) & set(held)
    assert 0.17 < len(held) / 2000 < 0.23
    assert split_prompts(prompts, 0.2) == (train, held)

    more = prompts + [f"a new prompt {i}" for i in range(500)]
    random.Random(1).shuffle(more)
    train2, held2 = split_prompts(more, 0.2)
    assert set(held) <= set(held2) and set(train) <= set(train2)
    assert set(held2) - set(held) == {p for p in held2 if p.startswith("a new")}

    _, salted = split_prompts(prompts, 0.2, salt="other")
    assert set(salted) != set(held)
    assert split_prompts(prompts, 0.0) == (prompts, [])


def test_encode_prompts_uses_chat_template_with_generation_prompt() -> None:
    tok = chat_tokenizer()
    cfg = PromptConfig(source="x", system_prompt="be kind")
    (ids,) = encode_prompts(tok, ["w1 w2"], cfg)
    expected = "<bos> system be kind <eos> <bos> user w1 w2 <eos> <bos> assistant"
    assert tok.convert_ids_to_tokens(ids) == expected.split()
    # identical to what transformers itself produces for the same conversation
    messages = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "w1 w2"}]
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def test_encode_prompts_without_template_tokenises_raw_text() -> None:
    cfg = PromptConfig(source="x")
    for tok, use in ((chat_tokenizer(None), True), (chat_tokenizer(), False)):
        (ids,) = encode_prompts(tok, ["w1 w2"], cfg.model_copy(update={"use_chat_template": use}))
        assert tok.convert_ids_to_tokens(ids) == ["w1", "w2"]
