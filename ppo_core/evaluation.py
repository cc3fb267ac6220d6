"""Evaluating a policy on held-out prompts: KL to the reference, proxy and gold reward, win rate.

The KL to the reference (exact, k1, k3) comes from `ppo_core.eval_kl`.

Win rate (AlpacaEval style): the fraction of prompts where the policy's response scores higher
than the reference's response to the same prompt, ties counted 0.5. The reference sample is
drawn once (`evaluate_reference`) and reused for every round, so rounds are compared against
the same responses; it uses its own seed so that the two samples are independent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from pydantic import Field
from torch import nn
from transformers import PreTrainedTokenizerBase

from ppo_core.config import SamplingConfig, StrictModel
from ppo_core.eval_kl import SequenceKL, exact_kl, sampled_kl, sequence_kl
from ppo_core.models import stop_token_ids
from ppo_core.rollout import generate, left_pad

Scorer = Callable[[list[str], list[str]], torch.Tensor | Sequence[float]]
"""score(prompts, responses) -> one float per pair: the reward model's normalised score (proxy)
or a programmatic judge such as VADER (gold). Any callable works; nothing here depends on the
reward-model class."""

__all__ = [
    "EvalSample",
    "PolicyEval",
    "ReferenceSample",
    "Scorer",
    "SequenceKL",
    "evaluate_policy",
    "evaluate_reference",
    "exact_kl",
    "sampled_kl",
    "sequence_kl",
    "win_rate",
]

REFERENCE_SEED = 1
"""Default seed of the reference sample; differs from `evaluate_policy`'s default (0) so the
policy and reference responses are independent draws."""


# ---- result models --------------------------------------------------------------------------
class EvalSample(StrictModel):
    """One prompt with the policy's and the reference's responses, for side-by-side display."""

    prompt: str
    """The raw prompt text (as the scorers saw it)."""
    response: str
    """The evaluated policy's response."""
    reference_response: str | None = None
    """The reference policy's response to the same prompt (None when no reference sample)."""
    proxy: float
    """Proxy (reward model) score of `response`."""
    reference_proxy: float | None = None
    """Proxy score of `reference_response`."""
    gold: float | None = None
    """Gold score of `response` (None without a gold scorer)."""
    reference_gold: float | None = None
    """Gold score of `reference_response`."""


class ReferenceSample(StrictModel):
    """The reference policy's responses to the held-out prompts and their scores, drawn once and
    reused so that every round's win rate is measured against the same responses."""

    prompts: list[str]
    """Prompt texts, in evaluation order."""
    responses: list[str]
    """One reference response per prompt."""
    proxy_scores: list[float]
    """Proxy score per response."""
    gold_scores: list[float] | None = None
    """Gold score per response (None without a gold scorer)."""
    seed: int | None = None
    """Sampling seed the responses were drawn with (None when supplied by the caller)."""


class PolicyEval(StrictModel):
    """Aggregate evaluation of one policy on held-out prompts. KLs are means over prompts of the
    per-sequence sums (nats); scores are means over prompts."""

    n: int = Field(ge=0)
    """Number of prompts (= responses) evaluated."""
    kl_exact: float
    """Mean sequence KL(pi || pi_ref), exact over the full next-token distributions."""
    kl_k1: float
    """Mean sequence sum of k1 = log r (unbiased, high variance, may be negative)."""
    kl_k3: float
    """Mean sequence sum of k3 = (1/r - 1) + log r (unbiased, >= 0)."""
    proxy_reward: float
    """Mean proxy (reward model) score."""
    proxy_reward_se: float = 0.0
    """Standard error of `proxy_reward` (std / sqrt(n))."""
    gold_reward: float | None = None
    """Mean gold score; None without a gold scorer."""
    gold_reward_se: float | None = None
    """Standard error of `gold_reward`."""
    win_rate_proxy: float | None = None
    """Fraction of prompts where the proxy prefers this policy's response to the reference's (ties 0.5)."""
    win_rate_gold: float | None = None
    """Same, judged by the gold scorer."""
    response_length: float
    """Mean response length in tokens (stop token included)."""
    eos_rate: float
    """Fraction of responses that emitted a stop token before max_new_tokens."""
    samples: list[EvalSample] = Field(default_factory=list)
    """A few prompts with both responses side by side."""

    def kl(self, estimator: str = "exact") -> float:
        """The mean sequence KL by estimator name: exact, k1 or k3."""
        return {"exact": self.kl_exact, "k1": self.kl_k1, "k3": self.kl_k3}[estimator]


# ---- scoring helpers ------------------------------------------------------------------------
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
    """mean over prompts of 1[s > s_ref] + 0.5 * 1[s == s_ref]."""
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


# ---- sampling -------------------------------------------------------------------------------
class Responses(NamedTuple):
    """Decoded responses of one model to all prompts, with per-sequence KL when a reference was given."""

    texts: list[str]
    lengths: list[float]
    ended: list[float]
    kl: SequenceKL | None


@torch.no_grad()
def sample_responses(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    seed: int,
    batch_size: int = 16,
    ref: nn.Module | None = None,
    chunk_size: int = 1024,
) -> Responses:
    """One sampled response per prompt, in prompt order, with a fixed seed that leaves the
    caller's RNG state untouched; with `ref`, also the per-sequence KL of each batch."""
    stops, pad = stop_token_ids(tokenizer, sampling.stop_token_ids), int(tokenizer.pad_token_id)
    device = _device(model)
    texts: list[str] = []
    lengths: list[float] = []
    ended: list[float] = []
    kls: list[SequenceKL] = []
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, len(prompt_ids), batch_size):
            query_ids, query_mask = left_pad(prompt_ids[start : start + batch_size], pad)
            rollout = generate(
                model, query_ids, query_mask, sampling, stops, pad, want_logprobs=False
            )
            rollout = rollout.trimmed()
            for ids, mask in zip(rollout.response_ids, rollout.response_mask, strict=True):
                texts.append(tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True))
            lengths += rollout.response_mask.sum(1).float().tolist()
            ended += rollout.ended.float().tolist()
            if ref is not None:
                kls.append(sequence_kl(model, ref, rollout, sampling.temperature, chunk_size))
    model.train(was_training)
    kl = SequenceKL(*(torch.cat([k[i].cpu() for k in kls]) for i in range(3))) if kls else None
    return Responses(texts, lengths, ended, kl)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_prompts(prompt_texts: Sequence[str], prompt_ids: Sequence[Sequence[int]]) -> None:
    if len(prompt_texts) != len(prompt_ids) or not prompt_texts:
        raise ValueError(
            f"need one token list per prompt text ({len(prompt_texts)} vs {len(prompt_ids)})"
        )


# ---- the two entry points -------------------------------------------------------------------
def evaluate_reference(
    ref: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    prompt_ids: list[list[int]],
    sampling: SamplingConfig,
    proxy: Scorer,
    gold: Scorer | None = None,
    seed: int = REFERENCE_SEED,
    batch_size: int = 16,
    n_samples: int = 4,
) -> tuple[PolicyEval, ReferenceSample]:
    """The baseline: the reference's own scores (KL 0 and win rate 0.5 by definition), and the
    sample every later round is compared against."""
    _check_prompts(prompt_texts, prompt_ids)
    out = sample_responses(ref, tokenizer, prompt_ids, sampling, seed, batch_size)
    prompts = list(prompt_texts)
    sample = ReferenceSample(
        prompts=prompts,
        responses=out.texts,
        proxy_scores=score(proxy, prompts, out.texts),
        gold_scores=score(gold, prompts, out.texts) if gold is not None else None,
        seed=seed,
    )
    proxy_mean, proxy_se = mean_and_se(sample.proxy_scores)
    gold_stats = mean_and_se(sample.gold_scores) if sample.gold_scores is not None else (None, None)
    baseline = PolicyEval(
        n=len(prompts),
        kl_exact=0.0,
        kl_k1=0.0,
        kl_k3=0.0,
        proxy_reward=proxy_mean,
        proxy_reward_se=proxy_se,
        gold_reward=gold_stats[0],
        gold_reward_se=gold_stats[1],
        win_rate_proxy=0.5,
        win_rate_gold=0.5 if gold is not None else None,
        response_length=sum(out.lengths) / len(out.lengths),
        eos_rate=sum(out.ended) / len(out.ended),
        samples=_samples(
            None, out.texts, sample.proxy_scores, sample.gold_scores, n_samples, prompts
        ),
    )
    return baseline, sample


def evaluate_policy(
    policy: nn.Module,
    ref: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    prompt_ids: list[list[int]],
    sampling: SamplingConfig,
    proxy: Scorer,
    gold: Scorer | None = None,
    ref_responses: ReferenceSample | Sequence[str] | None = None,
    seed: int = 0,
    batch_size: int = 16,
    n_samples: int = 4,
    chunk_size: int = 1024,
) -> PolicyEval:
    """Sample the policy once per held-out prompt (fixed seed), then measure KL, scores and, given
    the reference's responses to the same prompts, win rates. `ref_responses` is best the
    `ReferenceSample` from `evaluate_reference` (scores reused); plain strings are scored here;
    None skips the win rates."""
    _check_prompts(prompt_texts, prompt_ids)
    prompts = list(prompt_texts)
    out = sample_responses(
        policy, tokenizer, prompt_ids, sampling, seed, batch_size, ref, chunk_size
    )
    assert out.kl is not None
    proxy_scores = score(proxy, prompts, out.texts)
    gold_scores = score(gold, prompts, out.texts) if gold is not None else None
    reference = _as_reference(ref_responses, prompts, proxy, gold)
    win_proxy = win_gold = None
    if reference is not None:
        win_proxy = win_rate(proxy_scores, reference.proxy_scores)
        if gold_scores is not None and reference.gold_scores is not None:
            win_gold = win_rate(gold_scores, reference.gold_scores)
    proxy_mean, proxy_se = mean_and_se(proxy_scores)
    gold_stats = mean_and_se(gold_scores) if gold_scores is not None else (None, None)
    return PolicyEval(
        n=len(prompts),
        kl_exact=out.kl.exact.mean().item(),
        kl_k1=out.kl.k1.mean().item(),
        kl_k3=out.kl.k3.mean().item(),
        proxy_reward=proxy_mean,
        proxy_reward_se=proxy_se,
        gold_reward=gold_stats[0],
        gold_reward_se=gold_stats[1],
        win_rate_proxy=win_proxy,
        win_rate_gold=win_gold,
        response_length=sum(out.lengths) / len(out.lengths),
        eos_rate=sum(out.ended) / len(out.ended),
        samples=_samples(reference, out.texts, proxy_scores, gold_scores, n_samples, prompts),
    )


def _as_reference(
    ref_responses: ReferenceSample | Sequence[str] | None,
    prompts: list[str],
    proxy: Scorer,
    gold: Scorer | None,
) -> ReferenceSample | None:
    if ref_responses is None:
        return None
    if isinstance(ref_responses, ReferenceSample):
        if ref_responses.prompts != prompts:
            raise ValueError(
                "the reference sample was drawn for different prompts (or in another order)"
            )
        return ref_responses
    responses = list(ref_responses)
    if len(responses) != len(prompts):
        raise ValueError(f"{len(responses)} reference responses for {len(prompts)} prompts")
    return ReferenceSample(
        prompts=prompts,
        responses=responses,
        proxy_scores=score(proxy, prompts, responses),
        gold_scores=score(gold, prompts, responses) if gold is not None else None,
    )


def _samples(
    reference: ReferenceSample | None,
    texts: list[str],
    proxy: list[float],
    gold: list[float] | None,
    n: int,
    prompts: list[str],
) -> list[EvalSample]:
    rows = []
    for i in range(min(n, len(texts))):
        rows.append(
            EvalSample(
                prompt=prompts[i],
                response=texts[i],
                reference_response=reference.responses[i] if reference else None,
                proxy=proxy[i],
                reference_proxy=reference.proxy_scores[i] if reference else None,
                gold=gold[i] if gold is not None else None,
                reference_gold=reference.gold_scores[i]
                if reference and reference.gold_scores
                else None,
            )
        )
    return rows
