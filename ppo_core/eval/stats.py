"""Statistics of an evaluation: checked scorer calls, win rate, means with standard errors.

With several responses per prompt, the responses to one prompt are not independent (an
upbeat prompt gets upbeat answers), so standard errors are taken over per-prompt means
(a cluster-robust SE): n·k responses to n prompts give an SE over n values, not n·k.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

Scorer = Callable[[list[str], list[str]], torch.Tensor | Sequence[float]]
"""score(prompts, responses) -> one float per pair: the reward model's normalised score (proxy)
or a programmatic judge such as VADER (gold). Any callable works; nothing here depends on the
reward-model class."""


def score(scorer: Scorer, prompts: list[str], responses: list[str]) -> list[float]:
    """Call a scorer and check it returned one finite float per response."""
    raw = scorer(prompts, responses)
    values = (
        raw.detach().float().reshape(-1).cpu().tolist()
        if torch.is_tensor(raw)
        else [float(v) for v in raw]
    )
    if len(values) != len(responses):
        raise ValueError(f"scorer returned {len(values)} scores for {len(responses)} responses")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"scorer returned non-finite scores at rows {bad[:5]}")
    return values


def win_rate(scores: Sequence[float], ref_scores: Sequence[float]) -> float:
    """mean over paired responses of 1[s > s_ref] + 0.5 * 1[s == s_ref]."""
    if len(scores) != len(ref_scores) or not scores:
        raise ValueError(
            f"win rate needs paired, non-empty scores ({len(scores)} vs {len(ref_scores)})"
        )
    wins = sum(
        1.0 if s > r else 0.5 if s == r else 0.0 for s, r in zip(scores, ref_scores, strict=True)
    )
    return wins / len(scores)


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Sample mean and its standard error std / sqrt(n) (Bessel-corrected; 0 for n < 2)."""
    x = torch.tensor(list(values), dtype=torch.float64)
    if x.numel() < 2:
        return float(x.mean()) if x.numel() else 0.0, 0.0
    return float(x.mean()), float(x.std() / x.numel() ** 0.5)


def prompt_mean_and_se(values: Sequence[float], n_prompts: int) -> tuple[float, float]:
    """Mean and standard error over prompts of values laid out prompt-major per sample:
    value i belongs to prompt i % n_prompts (the prompt list tiled k times). The mean equals
    the plain mean; the SE is that of the n_prompts per-prompt means."""
    if n_prompts < 1 or len(values) % n_prompts:
        raise ValueError(f"{len(values)} values do not tile {n_prompts} prompts")
    x = torch.tensor(list(values), dtype=torch.float64).reshape(-1, n_prompts)
    return mean_and_se(x.mean(0).tolist())
