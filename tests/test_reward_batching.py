"""Reward-model batching: each distinct response scored once per step, training grouped by
prompt (InstructGPT), and which pairs may evaluate the RM (no truncations held out)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from ppo_core.data.preferences import PreferenceRow
from ppo_core.data.prompts import reward_eval_prompts
from ppo_core.reward.config import RewardModelConfig
from ppo_core.reward.model import RewardModel
from ppo_core.reward.training import (
    pair_scores,
    split_reward_rows,
    train_reward_model,
    training_units,
)
from tests.test_reward_model import BAD, GOOD, NEUTRAL, bert_rm_dir, llama_rm_dir, word_gold


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def grouped_rows(n_prompts: int, seed: int) -> list[PreferenceRow]:
    """Per prompt: two answers with a good word, two with a bad one, and the 4 good > bad pairs
    (the layout of k sampled responses per prompt)."""
    rng = random.Random(seed)

    def answer(sentiment: list[str]) -> str:
        words = rng.sample(NEUTRAL, 4)
        words.insert(rng.randrange(5), rng.choice(sentiment))
        return " ".join(words)

    rows: list[PreferenceRow] = []
    prompts = list(itertools.permutations(NEUTRAL, 3))
    for prompt in map(" ".join, rng.sample(prompts, n_prompts)):  # distinct prompts
        good, bad = [answer(GOOD) for _ in range(2)], [answer(BAD) for _ in range(2)]
        rows += [PreferenceRow(prompt=prompt, chosen=g, rejected=b) for g in good for b in bad]
    return rows


def test_pair_scores_scores_each_distinct_response_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(llama_rm_dir(tmp_path))
    responses = ["w1 w2", "w3", "w4 w5 w6", "w7"]
    rows = [
        PreferenceRow(prompt="w20", chosen=a, rejected=b)
        for a, b in itertools.combinations(responses, 2)
    ] + [PreferenceRow(prompt="w21", chosen="w1 w2", rejected="w3")]  # same text, other prompt
    seen: list[int] = []
    raw_scores = rm.raw_scores
    rm.raw_scores = lambda p, r: seen.append(len(r)) or raw_scores(p, r)  # type: ignore[method-assign]
    r_c, r_r = pair_scores(rm, rows)
    assert seen == [4 + 2]  # one forward; 6 + 1 pairs, 4 + 2 distinct (prompt, response)
    alone = rm.score([r.prompt for r in rows] * 2, [r.chosen for r in rows] + [r.rejected for r in rows])
    assert torch.allclose(torch.cat([r_c, r_r]).detach(), alone, atol=1e-5)


def test_training_units_group_pairs_by_prompt() -> None:
    rows = grouped_rows(3, seed=0)
    assert training_units(rows, False) == [[r] for r in rows]
    units = training_units(rows, True)
    assert [len(u) for u in units] == [4, 4, 4] and [r for u in units for r in u] == rows
    assert all(len({r.prompt for r in u}) == 1 for u in units)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_tiny_rm_learns_with_batches_grouped_by_prompt(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    forwards: list[int] = []
    raw_scores = RewardModel.raw_scores
    monkeypatch.setattr(
        RewardModel, "raw_scores", lambda rm, p, r: forwards.append(len(r)) or raw_scores(rm, p, r)
    )
    backbone = llama_rm_dir(tmp_path) if kind == "llama" else bert_rm_dir(tmp_path)
    cfg = RewardModelConfig(
        backbone=str(backbone), learning_rate=3e-3, epochs=3, group_by_prompt=True,
        prompts_per_step=4, batch_size=8, device="cpu",  # batch_size: pairs, unused here
    )
    _, report = train_reward_model(
        cfg, grouped_rows(64, 0), grouped_rows(25, 1), gold_scorer=word_gold
    )
    assert report.steps == 3 * 64 // 4  # steps count prompts, not pairs
    # each step: 4 prompts x 4 distinct answers, each scored once (not 16 pairs x 2)
    assert forwards[: report.steps] == [16] * report.steps
    assert report.n_train == 256 and report.eval_accuracy >= 0.9, report
    assert report.gold_agreement >= 0.9


def test_held_out_rm_pairs_leave_truncations_out_training_keeps_them() -> None:
    prompts = [f"prompt {i}" for i in range(40)]
    held = reward_eval_prompts(prompts)
    assert held and len(held) < len(prompts)
    rows = [
        PreferenceRow(prompt=p, chosen="a b c", rejected=text, metadata=meta)
        for p in prompts
        for text, meta in (("x y z", {}), ("a b", {"truncated": True}))
    ]
    train, held_out = split_reward_rows(rows)
    assert {r.prompt for r in held_out} == held and {r.prompt for r in train} == set(prompts) - held
    assert not any(r.metadata.get("truncated") for r in held_out) and len(held_out) == len(held)
    assert sum(bool(r.metadata.get("truncated")) for r in train) == len(prompts) - len(held)

