"""Per-token rewards (ppo_core.ppo.rewards): the score lands on the stop token, pads get nothing.

r_t = -beta KL_t on every valid token, plus the sequence score on the last valid token, which
for a response that stopped is the EOS itself (the action that ended it).
"""

from __future__ import annotations

import pytest
import torch

from ppo_core.lm.rollout import truncate_after_stop
from ppo_core.ppo.rewards import last_token_index, shape_scores, token_rewards

PAD, EOS = 0, 1


def test_score_sits_on_the_eos_token_never_on_a_pad() -> None:
    raw = torch.tensor(
        [
            [5, 6, EOS, 7, 8, 9],  # stops at 2; 7 8 9 must become pads
            [5, 6, 7, 8, 9, 10],  # never stops: score on the last column
            [EOS, 5, 6, EOS, 7, 8],  # stops immediately
            [5, EOS, EOS, 6, 7, 8],
        ]
    )
    ids, mask, ended = truncate_after_stop(raw, [EOS], PAD)
    scores = torch.tensor([2.0, -1.0, 3.0, 0.5])
    kl = torch.zeros(ids.shape)
    rewards = token_rewards(scores, kl, mask, beta=0.1)
    eos_at = torch.tensor([2, 5, 0, 1])
    rows = torch.arange(4)
    torch.testing.assert_close(rewards[rows, eos_at], scores)
    assert ids[0, 2] == EOS and ids[2, 0] == EOS and ids[3, 1] == EOS
    rest = torch.ones_like(rewards, dtype=torch.bool)
    rest[rows, eos_at] = False
    assert torch.all(rewards[rest] == 0)
    assert torch.all(ids[mask == 0] == PAD)
    assert ended.tolist() == [True, False, True, True]


def test_kl_penalty_on_every_valid_token_and_score_added_at_the_end() -> None:
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    kl = torch.arange(15, dtype=torch.float32).view(3, 5) / 10 + 0.1
    scores = torch.tensor([1.0, 2.0, 3.0])
    beta = 0.5
    rewards = token_rewards(scores, kl, mask, beta)
    expected = -beta * kl * mask
    expected[0, 2] += 1.0
    expected[1, 4] += 2.0
    expected[2, 0] += 3.0
    torch.testing.assert_close(rewards, expected)
    assert torch.all(rewards[mask == 0] == 0)


def test_all_pad_row_gets_no_reward_at_all() -> None:
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    rewards = token_rewards(torch.tensor([5.0, 1.0]), torch.ones(2, 3), mask, beta=0.0)
    assert torch.all(rewards[0] == 0)
    assert rewards[1].tolist() == [0.0, 1.0, 0.0]
    assert last_token_index(mask).tolist() == [0, 1]


def test_whitened_rewards_keep_their_mean_and_get_unit_variance() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    kl = torch.rand(2, 4, generator=gen)
    plain = token_rewards(torch.tensor([3.0, -1.0]), kl, mask, beta=0.2)
    white = token_rewards(torch.tensor([3.0, -1.0]), kl, mask, beta=0.2, whiten=True)
    valid_p, valid_w = plain[mask.bool()], white[mask.bool()]
    assert valid_w.mean().item() == pytest.approx(valid_p.mean().item(), abs=1e-5)
    assert valid_w.std().item() == pytest.approx(1.0, abs=1e-4)
    assert white[0, 3].item() == 0.0


def test_missing_eos_penalty_only_hits_rows_that_never_stopped() -> None:
    scores = torch.tensor([1.0, 1.0, -2.0, 0.0])
    ended = torch.tensor([True, False, False, True])
    shaped = shape_scores(scores, ended, missing_eos_penalty=3.0)
    assert shaped.tolist() == [1.0, -2.0, -5.0, 0.0]
    assert shape_scores(scores, ended).tolist() == scores.tolist()


def test_score_clip_bounds_scores_after_the_penalty() -> None:
    scores = torch.tensor([10.0, -10.0, 0.5, 2.5])
    ended = torch.tensor([True, True, True, False])
    shaped = shape_scores(scores, ended, missing_eos_penalty=1.0, score_clip=2.0)
    assert shaped.tolist() == [2.0, -2.0, 0.5, 1.5]
