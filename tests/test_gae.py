"""GAE (ppo_core.ppo.advantages) against a plain per-sequence loop written from the paper.

Schulman et al. 2016, eq. (16): delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lam)^l
delta_{t+l}; the state after a sequence's last valid token is terminal (V = 0), and nothing
in the padding may leak into any advantage.
"""

from __future__ import annotations

import pytest
import torch

from ppo_core.ppo.advantages import gae, whiten_advantages


def reference_gae(
    rewards: torch.Tensor, values: torch.Tensor, lengths: list[int], gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence at a time over its valid prefix; pads stay 0 in both outputs."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    ret = torch.zeros_like(rewards, dtype=torch.float64)
    for row, length in enumerate(lengths):
        running = 0.0
        for t in reversed(range(length)):
            next_value = float(values[row, t + 1]) if t + 1 < length else 0.0
            delta = float(rewards[row, t]) + gamma * next_value - float(values[row, t])
            running = delta + gamma * lam * running
            adv[row, t] = running
            ret[row, t] = running + float(values[row, t])
    return adv, ret


def ragged(lengths: list[int], width: int, seed: int = 0):
    """Random rewards and values everywhere (garbage in the pads too) and a prefix mask."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)
    values = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return rewards, values, mask


LENGTHS = [7, 1, 4, 0, 7, 2]


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (0.5, 0.0)])
def test_gae_matches_per_sequence_loop_on_ragged_batch(gamma: float, lam: float) -> None:
    rewards, values, mask = ragged(LENGTHS, width=7, seed=int(gamma * 100 + lam * 10))
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, LENGTHS, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-10, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=1e-10, rtol=0)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_gae_ignores_whatever_sits_in_the_padding() -> None:
    rewards, values, mask = ragged(LENGTHS, width=7, seed=3)
    adv, ret = gae(rewards, values, mask, 0.97, 0.9)
    noisy_r = torch.where(mask.bool(), rewards, torch.full_like(rewards, 1e3))
    noisy_v = torch.where(mask.bool(), values, torch.full_like(values, -1e3))
    adv2, ret2 = gae(noisy_r, noisy_v, mask, 0.97, 0.9)
    torch.testing.assert_close(adv, adv2, atol=1e-10, rtol=0)
    torch.testing.assert_close(ret, ret2, atol=1e-10, rtol=0)


def test_lam_one_gamma_one_is_reward_to_go_minus_value() -> None:
    rewards, values, mask = ragged(LENGTHS, width=7, seed=4)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    masked_r = rewards * mask
    # reward-to-go: sum_{k >= t} r_k over the valid prefix (a reversed cumulative sum)
    to_go = masked_r.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(adv, (to_go - values) * mask, atol=1e-10, rtol=0)
    torch.testing.assert_close(ret, to_go * mask, atol=1e-10, rtol=0)


def test_lam_one_discounted_is_discounted_reward_to_go_minus_value() -> None:
    gamma = 0.8
    rewards, values, mask = ragged([5, 3], width=5, seed=5)
    adv, _ = gae(rewards, values, mask, gamma=gamma, lam=1.0)
    for row, length in enumerate([5, 3]):
        for t in range(length):
            to_go = sum(gamma ** (k - t) * float(rewards[row, k]) for k in range(t, length))
            assert adv[row, t].item() == pytest.approx(to_go - float(values[row, t]), abs=1e-10)


def test_lam_zero_is_one_step_td_error() -> None:
    gamma = 0.9
    rewards, values, mask = ragged(LENGTHS, width=7, seed=6)
    adv, _ = gae(rewards, values, mask, gamma=gamma, lam=0.0)
    lengths = torch.tensor(LENGTHS)
    next_v = torch.cat([values[:, 1:], torch.zeros(len(LENGTHS), 1, dtype=values.dtype)], dim=1)
    # V after the last valid token is 0 (terminal)
    is_last = torch.arange(7)[None, :] == (lengths - 1)[:, None]
    next_v = torch.where(is_last, torch.zeros_like(next_v), next_v)
    td = (rewards + gamma * next_v - values) * mask
    torch.testing.assert_close(adv, td, atol=1e-10, rtol=0)


def test_whitened_advantages_have_zero_mean_unit_std_on_valid_tokens() -> None:
    rewards, values, mask = ragged(LENGTHS, width=7, seed=7)
    adv, _ = gae(rewards, values, mask, 1.0, 0.95)
    white = whiten_advantages(adv * 3.0 + 5.0, mask)
    valid = white[mask.bool()]
    assert valid.mean().abs().item() < 1e-9
    assert valid.std().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.all(white[mask == 0] == 0)
