"""Per-token rewards: the response score on the last real token, the KL leash on every token.

    r_t = -beta * KL_t                      for every valid response token t
    r_T += r_phi(x, y)                      on the last valid token T (the stop token if any)

(Ziegler et al. 2019; Ouyang et al. 2022.) Pads never receive a reward.
"""

from __future__ import annotations

import torch

from ppo_core.lm.masked import Reduce, masked_whiten, no_reduce


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid token of each row (0 for an all-pad row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(dim=1).values


def shape_scores(
    scores: torch.Tensor,
    ended: torch.Tensor,
    missing_eos_penalty: float | None = None,
    score_clip: float | None = None,
) -> torch.Tensor:
    """Apply the EOS trick (penalise responses that never stopped) and optional clipping."""
    scores = scores.float()
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~ended.bool()).float()
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    return scores


def token_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    whiten: bool = False,
    reduce: Reduce = no_reduce,
) -> torch.Tensor:
    """Rewards [batch, response_len]: -beta*KL_t everywhere valid, plus the score at the last token.

    Pass beta=0 (or a zero kl tensor) when the KL is applied as a loss term instead.
    """
    maskf = mask.to(kl.dtype)
    rewards = -beta * kl * maskf
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype) * (maskf.sum(1) > 0)
    if whiten:
        rewards = masked_whiten(rewards, mask, shift_mean=False, reduce=reduce)
    return rewards
