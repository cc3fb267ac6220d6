"""Labelers: VADER gold scores, Bradley-Terry rater noise, sampling groups, human label files."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from ppo_core.config import SamplingConfig
from ppo_core.data.config import PromptConfig
from ppo_core.data.labelers import (
    export_unlabeled,
    import_labels,
    label_pairs,
    load_gold_scorer,
    sample_response_groups,
    vader_scores,
    word_truncations,
)
from tests.tiny import tiny_llama, tiny_tokenizer


def test_vader_prefers_clearly_positive_text() -> None:
    good, bad, flat = vader_scores(
        [
            "What a wonderful, delightful evening. I loved it!",
            "Awful food, rude staff, a horrible night.",
            "The bus",
        ]
    )
    assert good > 0.5 and bad < -0.5 and good > flat > bad
    assert all(-1.0 <= s <= 1.0 for s in (good, bad, flat))


def test_gold_scorer_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vader = load_gold_scorer("vader")
    assert vader(["ignored prompt", "x"], ["I love it", "I hate it"]) == vader_scores(
        ["I love it", "I hate it"]
    )
    (tmp_path / "my_scorers.py").write_text(
        "def by_length(prompts, responses):\n    return [float(len(r)) for r in responses]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_gold_scorer("my_scorers:by_length")(["p"], ["abc"]) == [3.0]
    for bad in ("nope", "my_scorers:missing", ":f"):
        with pytest.raises(ValueError, match="labeler"):
            load_gold_scorer(bad)


def table_scorer(table: dict[str, float]):
    return lambda prompts, responses: [table[r] for r in responses]


def _many_groups(n: int) -> list[tuple[str, list[str]]]:
    return [(f"p{i}", [f"hi{i}", f"lo{i}"]) for i in range(n)]


def _scores(n: int, gap: float) -> dict[str, float]:
    table = {f"hi{i}": gap for i in range(n)}
    table.update({f"lo{i}": 0.0 for i in range(n)})
    return table


def _share_high_chosen(rows) -> float:
    return sum(r.chosen.startswith("hi") for r in rows) / len(rows)


def test_bradley_terry_noise_limits_and_middle() -> None:
    n = 4000
    groups = _many_groups(n)
    scorer = table_scorer(_scores(n, gap=0.3))
    deterministic = label_pairs(groups, scorer, noise_temperature=None)
    assert _share_high_chosen(deterministic) == 1.0
    cold = label_pairs(groups, scorer, noise_temperature=1e-6, seed=3)
    assert [(r.chosen, r.rejected) for r in cold] == [(r.chosen, r.rejected) for r in deterministic]
    hot = label_pairs(groups, scorer, noise_temperature=1e6, seed=3)
    assert abs(_share_high_chosen(hot) - 0.5) < 0.03  # 4000 coin flips: 3 sigma is ~0.024
    middle = label_pairs(groups, scorer, noise_temperature=0.3, seed=3)  # P = sigmoid(1) = 0.731
    assert abs(_share_high_chosen(middle) - 1 / (1 + math.exp(-1))) < 0.03
    assert label_pairs(groups, scorer, 0.3, seed=3) == middle  # seeded


def test_pairs_per_group_gold_metadata_and_gap_filter() -> None:
    groups = [("p", ["a", "b", "c"]), ("q", ["same", "same"])]
    scorer = table_scorer({"a": 0.9, "b": 0.0, "c": 0.85, "same": 0.1})
    rows = label_pairs(groups, scorer)
    assert {(r.chosen, r.rejected) for r in rows} == {
        ("a", "b"),
        ("a", "c"),
        ("c", "b"),
    }  # 3 choose 2
    a_b = next(r for r in rows if (r.chosen, r.rejected) == ("a", "b"))
    assert a_b.metadata == {"gold_chosen": 0.9, "gold_rejected": 0.0} and a_b.prompt == "p"
    wide = label_pairs(groups, scorer, min_score_gap=0.1)
    assert {(r.chosen, r.rejected) for r in wide} == {("a", "b"), ("c", "b")}


def test_word_truncations_cut_at_word_ends_and_keep_the_spacing() -> None:
    text = "Sunny  day,\nwe walked to the\tlake"  # 7 words, odd spacing kept inside a prefix
    cuts = word_truncations(text, 3, random.Random(0))
    assert len(cuts) == len(set(cuts)) == 3
    assert [len(c) for c in cuts] == sorted(len(c) for c in cuts)  # shortest first
    for cut in cuts:
        assert text.startswith(cut) and cut != text  # a real prefix that drops something
        assert text[len(cut)].isspace() and not cut[-1].isspace()  # ends at a word end
        assert len(cut.split()) >= 2
    assert word_truncations(text, 99, random.Random(0)) == [
        "Sunny  day,", "Sunny  day,\nwe", "Sunny  day,\nwe walked", "Sunny  day,\nwe walked to",
        "Sunny  day,\nwe walked to the",
    ]  # every cut from 2 to 6 words
    assert word_truncations("two words", 3, random.Random(0)) == []


def test_truncated_pairs_are_labelled_and_flagged() -> None:
    groups = [("p", ["good day for a walk", "bad day"])]
    scorer = lambda prompts, responses: [float(len(r)) for r in responses]  # noqa: E731
    rows = label_pairs(groups, scorer, truncations=2)
    texts = {"good day for a walk", "bad day", "good day", "good day for", "good day for a"}
    assert {r.chosen for r in rows} | {r.rejected for r in rows} <= texts
    # 2 sampled + 2 truncations of the 5-word answer (the 2-word one has none): 4 choose 2 pairs
    assert len(rows) == 6 and all(len(r.chosen) > len(r.rejected) for r in rows)  # gold: longer
    sampled = [r for r in rows if not r.metadata.get("truncated")]
    assert [(r.chosen, r.rejected) for r in sampled] == [("good day for a walk", "bad day")]
    assert label_pairs(groups, scorer) == sampled  # truncations=0 labels exactly as before
    assert label_pairs(groups, scorer, truncations=2) == rows  # seeded


def test_sample_response_groups_gives_k_seeded_responses_per_prompt() -> None:
    torch.set_num_threads(1)
    tok, model = tiny_tokenizer(), tiny_llama()
    prompts = ["w1 w2", "w3", "w4 w5 w6"]
    sampling = SamplingConfig(max_new_tokens=6)
    cfg = PromptConfig(source="x", use_chat_template=False)
    groups = sample_response_groups(
        model, tok, prompts, cfg, k=3, sampling=sampling, batch_size=4, seed=1
    )
    assert [p for p, _ in groups] == prompts
    assert all(len(rs) == 3 for _, rs in groups)
    words = {w for _, rs in groups for r in rs for w in r.split()}
    assert words and words <= set(tok.get_vocab()) - {
        "<pad>",
        "<eos>",
        "<bos>",
    }  # special tokens stripped
    assert sample_response_groups(model, tok, prompts, cfg, 3, sampling, 4, seed=1) == groups
    assert sample_response_groups(model, tok, prompts, cfg, 3, sampling, 4, seed=2) != groups


def test_export_and_import_human_labels(tmp_path: Path) -> None:
    path = tmp_path / "to_label.jsonl"
    groups = [("p1", ["x1", "y1"]), ("p2", ["x2", "y2", "z2"]), ("p3", ["dup", "dup"])]
    assert export_unlabeled(groups, path) == 4  # 1 + 3 pairs, the identical pair left out
    items = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(item["preferred"] is None for item in items)
    for item, label in zip(items, ["a", "B", None, "maybe"], strict=True):
        item["preferred"] = label
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    rows = import_labels(path)
    assert [(r.prompt, r.chosen, r.rejected) for r in rows] == [
        ("p1", "x1", "y1"),
        ("p2", "y2", "x2"),
    ]
    assert rows[0].metadata["labeler"] == "human"
