"""Evaluating a policy on held-out prompts: KL to the reference, proxy and gold reward, win rate.

The KL to the reference (exact, k1, k3) comes from `ppo_core.eval.kl`.

Win rate (AlpacaEval style): the fraction of prompts where the policy's response scores higher
than the reference's response to the same prompt, ties counted 0.5. The reference sample is
drawn once (`evaluate_reference`) and reused for every round, so rounds are compared against
the same responses; it uses its own seed so that the two samples are independent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pydantic import Field
from torch import nn
from transformers import PreTrainedTokenizerBase

from ppo_core.config import SamplingConfig, StrictModel
from ppo_core.eval.kl import SequenceKL, sequence_kl
from ppo_core.eval.stats import Scorer, prompt_mean_and_se, score, win_rate
from ppo_core.lm.models import module_device
from ppo_core.lm.rollout import Rollout
from ppo_core.lm.sampling import SampledResponses, sample_responses

__all__ = [
    "EvalSample",
    "HeldOut",
    "PolicyEval",
    "ReferenceSample",
    "Scorer",
    "SequenceKL",
    "evaluate_policy",
    "evaluate_reference",
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
    """Number of prompts evaluated."""
    samples_per_prompt: int = Field(1, ge=1)
    """Responses sampled per prompt; means are over all n * samples_per_prompt responses,
    standard errors over the n per-prompt means."""
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
    gold_gain_se: float | None = None
    """Standard error of the gold gain over the reference (gold_reward minus the reference's),
    paired by prompt: prompt difficulty cancels, so it is below the two SEs combined."""
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


# ---- sampling -------------------------------------------------------------------------------
def _sample(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    seed: int,
    batch_size: int,
    ref: nn.Module | None = None,
    chunk_size: int = 1024,
) -> tuple[SampledResponses, SequenceKL | None]:
    """One response per prompt with a fixed seed that leaves the caller's RNG state untouched;
    with `ref`, also the per-sequence KL of each batch, at the sampling temperature."""
    kls: list[SequenceKL] = []

    def batch_kl(rollout: Rollout) -> None:
        kls.append(sequence_kl(model, ref, rollout, sampling.temperature, chunk_size))

    on_batch = batch_kl if ref is not None else None
    device = module_device(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = sample_responses(model, tokenizer, prompt_ids, sampling, batch_size, on_batch)
    kl = SequenceKL(*(torch.cat([k[i].cpu() for k in kls]) for i in range(3))) if kls else None
    return out, kl


# ---- the two entry points -------------------------------------------------------------------
@dataclass(frozen=True)
class HeldOut:
    """The held-out prompts and how every evaluation of them samples and scores responses:
    the reference and each round are evaluated with the same one."""

    tokenizer: PreTrainedTokenizerBase
    prompt_texts: Sequence[str]
    """Raw prompt texts, as the scorers see them."""
    prompt_ids: Sequence[Sequence[int]]
    """The same prompts encoded for the policy (chat template applied)."""
    sampling: SamplingConfig
    proxy: Scorer
    """The reward model's score (normalised)."""
    gold: Scorer | None = None
    """An independent judge (None: no gold scores, no gold win rate)."""
    batch_size: int = 16
    """Prompts sampled at once."""
    n_samples: int = 4
    """Side-by-side samples kept for the report."""
    samples_per_prompt: int = 1
    """Responses per prompt; means over all, standard errors over the per-prompt means."""


def evaluate_reference(
    ref: nn.Module, held: HeldOut, seed: int = REFERENCE_SEED
) -> tuple[PolicyEval, ReferenceSample]:
    """The baseline: the reference's own scores (KL 0 and win rate 0.5 by definition), and the
    sample every later round is compared against (`samples_per_prompt` responses per prompt,
    laid out as the prompt list repeated that many times)."""
    proxy, gold, samples_per_prompt = held.proxy, held.gold, held.samples_per_prompt
    prompts, ids = _tiled(held.prompt_texts, held.prompt_ids, samples_per_prompt)
    out, _ = _sample(ref, held.tokenizer, ids, held.sampling, seed, held.batch_size)
    sample = ReferenceSample(
        prompts=prompts,
        responses=out.texts,
        proxy_scores=score(proxy, prompts, out.texts),
        gold_scores=score(gold, prompts, out.texts) if gold is not None else None,
        seed=seed,
    )
    baseline = _policy_eval(
        out,
        prompts,
        len(held.prompt_texts),
        samples_per_prompt,
        sample.proxy_scores,
        sample.gold_scores,
        None,
        held.n_samples,
        kl_exact=0.0,
        kl_k1=0.0,
        kl_k3=0.0,
        win_rate_proxy=0.5,
        win_rate_gold=0.5 if gold is not None else None,
    )
    return baseline, sample


def evaluate_policy(
    policy: nn.Module,
    ref: nn.Module,
    held: HeldOut,
    ref_responses: ReferenceSample | Sequence[str] | None = None,
    seed: int = 0,
    chunk_size: int = 1024,
) -> PolicyEval:
    """Sample the policy `samples_per_prompt` times per held-out prompt (fixed seed), then
    measure KL, scores and, given the reference's responses to the same prompts, win rates and
    the paired gold gain. `ref_responses` is best the `ReferenceSample` from
    `evaluate_reference` (scores reused; drawn with the same `samples_per_prompt`); plain
    strings, one per sampled response, are scored here; None skips the comparisons."""
    proxy, gold, samples_per_prompt = held.proxy, held.gold, held.samples_per_prompt
    prompts, ids = _tiled(held.prompt_texts, held.prompt_ids, samples_per_prompt)
    out, kl = _sample(policy, held.tokenizer, ids, held.sampling, seed, held.batch_size, ref, chunk_size)
    assert kl is not None
    proxy_scores = score(proxy, prompts, out.texts)
    gold_scores = score(gold, prompts, out.texts) if gold is not None else None
    reference = _as_reference(ref_responses, prompts, proxy, gold)
    win_proxy = win_gold = gain_se = None
    n = len(held.prompt_texts)
    if reference is not None:
        win_proxy = win_rate(proxy_scores, reference.proxy_scores)
        if gold_scores is not None and reference.gold_scores is not None:
            win_gold = win_rate(gold_scores, reference.gold_scores)
            gains = [g - r for g, r in zip(gold_scores, reference.gold_scores, strict=True)]
            gain_se = prompt_mean_and_se(gains, n)[1]
    return _policy_eval(
        out,
        prompts,
        n,
        samples_per_prompt,
        proxy_scores,
        gold_scores,
        reference,
        held.n_samples,
        kl_exact=kl.exact.mean().item(),
        kl_k1=kl.k1.mean().item(),
        kl_k3=kl.k3.mean().item(),
        gold_gain_se=gain_se,
        win_rate_proxy=win_proxy,
        win_rate_gold=win_gold,
    )


def _policy_eval(
    out: SampledResponses,
    prompts: list[str],
    n: int,
    samples_per_prompt: int,
    proxy_scores: list[float],
    gold_scores: list[float] | None,
    reference: ReferenceSample | None,
    n_samples: int,
    **comparisons: float | None,
) -> PolicyEval:
    """The record both entry points share: score means and standard errors over the n prompts,
    lengths, stop rate and the side-by-side samples; `comparisons` carries the KL and win-rate
    fields, which only the caller knows."""
    proxy_mean, proxy_se = prompt_mean_and_se(proxy_scores, n)
    gold_mean, gold_se = (
        prompt_mean_and_se(gold_scores, n) if gold_scores is not None else (None, None)
    )
    return PolicyEval(
        n=n,
        samples_per_prompt=samples_per_prompt,
        proxy_reward=proxy_mean,
        proxy_reward_se=proxy_se,
        gold_reward=gold_mean,
        gold_reward_se=gold_se,
        response_length=sum(out.lengths) / len(out.lengths),
        eos_rate=sum(out.ended) / len(out.ended),
        samples=_samples(reference, out.texts, proxy_scores, gold_scores, n_samples, prompts),
        **comparisons,
    )


def _tiled(
    prompt_texts: Sequence[str], prompt_ids: Sequence[Sequence[int]], k: int
) -> tuple[list[str], list[Sequence[int]]]:
    """The prompt list repeated k times (response i answers prompt i % n): each batch mixes
    prompts, and the first responses shown in a report are to different prompts."""
    if len(prompt_texts) != len(prompt_ids) or not prompt_texts:
        raise ValueError(
            f"need one token list per prompt text ({len(prompt_texts)} vs {len(prompt_ids)})"
        )
    if k < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {k}")
    return list(prompt_texts) * k, list(prompt_ids) * k


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
