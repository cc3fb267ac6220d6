"""Turning a rollout into training data: scores, reference log-probs, values, rewards, GAE.

This is the "make experience" half of a PPO iteration. It runs under no_grad and never looks
at a token after a response's stop token (the rollout arrives trimmed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch

from ppo_core.lm.masked import Reduce, no_reduce
from ppo_core.lm.rollout import Rollout
from ppo_core.ppo.advantages import gae, whiten_advantages
from ppo_core.ppo.config import PPOConfig
from ppo_core.ppo.kl import kl_estimate
from ppo_core.ppo.rewards import shape_scores, token_rewards

ScoreFn = Callable[[Rollout], torch.Tensor]
"""Maps a rollout to one scalar score per response (a reward model, a gold scorer, a rule)."""


@dataclass
class Experience:
    """Everything the update epochs need, aligned on the rollout's response grid [B, R]."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    kl: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.response_mask

    def select(self, index: torch.Tensor) -> Experience:
        """Rows at `index`, trimmed to their own longest response and shortest left padding."""
        rows = {f.name: getattr(self, f.name)[index] for f in fields(self) if f.name != "rollout"}
        rollout = self.rollout.select(index)
        trimmed = rollout.trimmed()
        keep = trimmed.response_len
        rows = {k: v[:, :keep] if v.dim() == 2 else v for k, v in rows.items()}
        return replace(self, rollout=trimmed, **rows)


class PromptSampler:
    """Deterministic batches of prompt indices: iteration i takes positions [iB, (i+1)B) of an
    endless sequence of seeded permutations, so a resumed run draws exactly the same prompts
    without storing any sampler state."""

    def __init__(self, n_prompts: int, batch_size: int, seed: int) -> None:
        if n_prompts < 1:
            raise ValueError("PPO needs at least one prompt")
        self.n, self.batch_size, self.seed = n_prompts, batch_size, seed

    def _epoch(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=gen)

    def batch(self, iteration: int) -> list[int]:
        start = iteration * self.batch_size
        out: list[int] = []
        while len(out) < self.batch_size:
            epoch, offset = divmod(start + len(out), self.n)
            take = min(self.batch_size - len(out), self.n - offset)
            out += self._epoch(epoch)[offset : offset + take].tolist()
        return out


def in_chunks(n: int, size: int) -> Sequence[slice]:
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def compute_advantages(
    config: PPOConfig,
    rollout: Rollout,
    raw_scores: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    beta: float,
    reduce: Reduce = no_reduce,
) -> Experience:
    """Score shaping -> per-token KL -> rewards -> GAE -> whitening (pure tensor math).
    `reduce` sums whitening statistics over data-parallel ranks (ppo_core.lm.distributed)."""
    mask = rollout.response_mask
    maskf = mask.float()
    scores = shape_scores(raw_scores, rollout.ended, config.missing_eos_penalty, config.score_clip)
    kl = kl_estimate(old_logprobs, ref_logprobs, config.kl.estimator) * maskf
    reward_beta = beta if config.kl.in_reward else 0.0
    rewards = token_rewards(scores, kl, mask, reward_beta, config.whiten_rewards, reduce)
    advantages, returns = gae(rewards, values * maskf, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = whiten_advantages(advantages, mask, reduce)
    return Experience(
        rollout=rollout,
        old_logprobs=old_logprobs * maskf,
        ref_logprobs=ref_logprobs * maskf,
        values=values * maskf,
        scores=scores,
        kl=kl,
        rewards=rewards,
        advantages=advantages,
        returns=returns,
    )
