"""Autoregressive sampling with the KV cache: the loop `rollout.generate` runs.

Our own loop rather than transformers' `generate`, for two reasons measured on the CPU:
- its sampler (`torch.multinomial`) draws one exponential variate per vocabulary entry, per row,
  per step: for SmolLM2 (49,152 entries) that was a third of bf16 generation time. Sampling by
  the inverse CDF draws one uniform per row from the same categorical distribution.
- PPO needs log pi(a_t|s_t) of each sampled token only: taken per step ([B] floats) instead of
  keeping every step's [B, V] logits and gathering afterwards.

Semantics follow `generate` with do_sample=True and the library's processors in its order:
stop tokens suppressed before `min_new_tokens`, then temperature, top-k, top-p (nucleus, at
least one token kept). Rows that stopped are fed the pad id and still attend (as in `generate`);
the loop ends when every row has stopped or after `max_new_tokens`. Log-probs are those of
softmax(logits / T) before top-k/top-p and min-tokens, as PPO's training forward computes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ppo_core.config import SamplingConfig
from ppo_core.lm.models import unwrap_peft
from ppo_core.lm.packing import position_ids_from_mask


def warp_scores(logits: torch.Tensor, sampling: SamplingConfig, step: int, stop_ids: torch.Tensor) -> torch.Tensor:
    """[B, V] fp32 logits -> the scores sampled from at response position `step`."""
    scores = logits
    if step < sampling.min_new_tokens:
        scores = scores.index_fill(-1, stop_ids, float("-inf"))
    scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        scores = _nucleus(scores, sampling.top_p)
    return scores


def _nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop the least likely tokens whose total mass is at most 1 - top_p (the most likely kept)."""
    ascending, order = torch.sort(scores, dim=-1)
    drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[..., -1] = False
    return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def sample_categorical(scores: torch.Tensor) -> torch.Tensor:
    """[B, V] scores -> [B] token ids drawn from softmax(scores) by the inverse CDF: the first
    token whose cumulative probability reaches u ~ U(0, 1]. A token of probability 0 has the same
    cumulative value as the one before it, so it is never the first to reach u > 0."""
    cdf = scores.softmax(-1).cumsum(-1)
    u = (1.0 - torch.rand(cdf.shape[0], 1, device=cdf.device, dtype=cdf.dtype)) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=cdf.shape[-1] - 1)


@torch.no_grad()
def decode(
    model: nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    sampling: SamplingConfig,
    stop_ids: Sequence[int],
    pad_id: int,
    want_logprobs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample up to max_new_tokens per left-padded prompt row.

    Returns (raw [B, R] sampled ids, R <= max_new_tokens, pad after a row stopped;
    [B, R] fp32 log pi(a_t|s_t) at the sampling temperature, or None).
    """
    stops = torch.tensor(list(stop_ids), device=query_ids.device)
    mask = query_mask.long()
    positions = position_ids_from_mask(mask)
    running = torch.ones(query_ids.shape[0], dtype=torch.bool, device=query_ids.device)
    tokens, logprobs = [], []
    step_input, step_positions, cache = query_ids, positions, None
    params = inspect.signature(unwrap_peft(model).forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    with _contiguous_head_input(model):
        for step in range(sampling.max_new_tokens):
            out = model(input_ids=step_input, attention_mask=mask, position_ids=step_positions,
                        use_cache=True, **{cache_arg: cache}, **kwargs)
            logits = out.logits[:, -1].float()
            token = sample_categorical(warp_scores(logits, sampling, step, stops))
            if want_logprobs:
                logprobs.append(torch.log_softmax(logits / sampling.temperature, -1).gather(-1, token[:, None])[:, 0])
            token = torch.where(running, token, pad_id)
            tokens.append(token)
            running &= ~torch.isin(token, stops)
            if not running.any():
                break
            cache, step_input = getattr(out, cache_arg), token[:, None]
            step_positions = positions[:, -1:] + step + 1
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    raw = torch.stack(tokens, dim=1)
    return raw, (torch.stack(logprobs, dim=1) if want_logprobs else None)


@contextmanager
def _contiguous_head_input(model: nn.Module) -> Iterator[None]:
    """The prefill hands the LM head the last position's hidden states as a strided [B, 1, H]
    slice; torch 2.13 on the CPU multiplies that by expanding the [H, V] head weight over the batch
    (a [B, H, V] copy: 8.4 of 19 s for 96 rows x 32 bf16 tokens of SmolLM2-135M). A contiguous
    input takes the plain matmul."""
    head = unwrap_peft(model).get_output_embeddings()
    if head is None:
        yield
        return
    hook = head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        hook.remove()
