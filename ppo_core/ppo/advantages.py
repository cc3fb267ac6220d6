"""Generalised Advantage Estimation over response tokens.

Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. (16):
    delta_t = r_t + gamma V(s_{t+1}) - V(s_t)
    A_t     = sum_l (gamma lambda)^l delta_{t+l}
computed backwards as A_t = delta_t + gamma lambda A_{t+1}. The state after the last valid
response token is terminal: its value is 0, and nothing after it leaks into A_t.
"""

from __future__ import annotations

import torch

from ppo_core.lm.masked import Reduce, masked_whiten, no_reduce


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (= advantages + values), both zero on pads.

    rewards, values, mask: [batch, response_len]; mask is 1 on response tokens up to and
    including the stop token. Pads may sit anywhere after the valid prefix.
    """
    maskf = mask.to(values.dtype)
    values = values * maskf
    rewards = rewards * maskf
    length = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(last_gae)
        next_valid = maskf[:, t + 1] if t + 1 < length else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value * next_valid - values[:, t]
        last_gae = delta + gamma * lam * last_gae * next_valid
        advantages[:, t] = last_gae
    advantages = advantages * maskf
    returns = advantages + values
    return advantages, returns


def whiten_advantages(
    advantages: torch.Tensor, mask: torch.Tensor, reduce: Reduce = no_reduce
) -> torch.Tensor:
    """Mean 0, std 1 over valid tokens of the whole batch (pads stay 0)."""
    return masked_whiten(advantages, mask, shift_mean=True, reduce=reduce)
