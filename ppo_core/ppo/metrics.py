"""Metric names and their aggregation.

Every PPO iteration emits one flat dict through `on_metrics(iteration, metrics)`:

objective/scores            mean sequence score after shaping (EOS penalty, clipping)
objective/raw_scores        mean score as the scorer returned it
objective/kl                mean sequence KL to the reference (sum over tokens of the estimator)
objective/kl_coef           beta used for this iteration's rewards
objective/entropy           mean sequence entropy estimate, sum over tokens of -log pi(a_t)
objective/non_score_reward  mean sum over tokens of -beta * KL_t
objective/rlhf_reward       objective/scores + objective/non_score_reward
policy/approxkl             k3 estimate of KL(pi_old || pi_theta) during the update
policy/clipfrac             fraction of tokens where the ratio clip was active
policy/ratio_mean           mean importance ratio rho_t
policy/entropy              mean per-token entropy of pi_theta during the update
policy/epochs_completed     epochs run (fewer than ppo_epochs after a KL early stop)
loss/policy, loss/value, loss/total
val/mean, val/clipfrac, val/explained_variance
returns/mean, advantages/mean
response/length_mean, response/eos_rate
optim/grad_norm_policy, optim/grad_norm_critic, optim/skipped_steps, lr
time/rollout, time/score, time/forward, time/update, time/iteration   (seconds)
throughput/generated_tokens_per_s, throughput/tokens_per_s
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from ppo_core.lm.masked import masked_mean, masked_sum
from ppo_core.ppo.experience import Experience

MetricsCallback = Callable[[int, dict[str, float]], None]
"""on_metrics(step, metrics): how numbers leave the library (the pipeline wires it to MLflow)."""

MICRO_STEP_KEYS = (
    "loss/policy",
    "loss/value",
    "loss/total",
    "policy/approxkl",
    "policy/clipfrac",
    "policy/ratio_mean",
    "policy/entropy",
    "val/clipfrac",
    "val/explained_variance",
)
"""What one micro-batch step reports: token-weighted shares, so summing them over micro-batches
(and over data-parallel ranks) gives the minibatch's token mean."""


class MetricAccumulator:
    """Collects dicts of floats; reports per-key sums or means over the dicts added."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            self._sums[key] += float(value)
            self._counts[key] += 1

    def sums(self) -> dict[str, float]:
        return dict(self._sums)

    def means(self) -> dict[str, float]:
        return {k: self._sums[k] / self._counts[k] for k in self._sums}

    def total(self, key: str) -> float:
        return self._sums.get(key, 0.0)


def rollout_metrics(
    exp: Experience, beta: float, raw_scores: torch.Tensor, kl_in_reward: bool = True
) -> dict[str, float]:
    """Rollout-side metrics; with the KL as a loss term the reward has no non-score part."""
    mask = exp.mask
    seq_kl = masked_sum(exp.kl, mask, dim=1)
    non_score = -beta * seq_kl if kl_in_reward else torch.zeros_like(seq_kl)
    return {
        "objective/scores": exp.scores.mean().item(),
        "objective/raw_scores": raw_scores.mean().item(),
        "objective/kl": seq_kl.mean().item(),
        "objective/kl_coef": beta,
        "objective/entropy": masked_sum(-exp.old_logprobs, mask, dim=1).mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": (exp.scores + non_score).mean().item(),
        "val/mean": masked_mean(exp.values, mask).item(),
        "returns/mean": masked_mean(exp.returns, mask).item(),
        "advantages/mean": masked_mean(exp.advantages, mask).item(),
        "response/length_mean": mask.float().sum(1).mean().item(),
        "response/eos_rate": exp.rollout.ended.float().mean().item(),
    }


def timing_metrics(exp: Experience, marks: tuple[float, float, float, float, float], ppo_epochs: int) -> dict[str, float]:
    """Seconds per phase from the iteration's time marks (start, after rollout, scoring, the
    experience forwards, the update) and token throughputs."""
    t0, t1, t2, t3, t4 = marks
    tokens = int(exp.rollout.attention_mask.sum())
    return {
        "time/rollout": t1 - t0,
        "time/score": t2 - t1,
        "time/forward": t3 - t2,
        "time/update": t4 - t3,
        "time/iteration": t4 - t0,
        "throughput/generated_tokens_per_s": float(exp.mask.sum()) / max(t1 - t0, 1e-9),
        "throughput/tokens_per_s": tokens * (1 + ppo_epochs) / max(t4 - t0, 1e-9),
    }


def sample_table(exp: Experience | None, tokenizer: PreTrainedTokenizerBase, n: int = 8) -> list[dict[str, str | float]]:
    """The first n responses of an iteration, decoded, with score and sequence KL, for people."""
    if exp is None:
        return []
    rows = []
    for i in range(min(n, exp.scores.shape[0])):
        valid = exp.mask[i].bool()
        query = exp.rollout.query_ids[i][exp.rollout.query_mask[i].bool()]
        rows.append({
            "prompt": tokenizer.decode(query, skip_special_tokens=True),
            "response": tokenizer.decode(exp.rollout.response_ids[i][valid], skip_special_tokens=True),
            "score": round(float(exp.scores[i]), 4),
            "kl": round(float(exp.kl[i][valid].sum()), 4),
            "ended": bool(exp.rollout.ended[i]),
        })
    return rows
