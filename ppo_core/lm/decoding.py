"""Autoregressive sampling with the KV cache: the loop `rollout.generate` runs.

Our own loop rather than transformers' `generate`, for two reasons measured on the CPU:
- its sampler (`torch.multinomial`) draws one exponential variate per vocabulary entry, per row,
  per step: for SmolLM2 (49,152 entries) that was a third of bf16 generation time. Sampling by
  the inverse CDF draws one uniform per row from the same categorical distribution.
- PPO needs log pi(a_t|s_t) of each sampled token only: taken per step ([B] floats) instead of
  keeping every step's [B, V] logits and gathering afterwards.

The prefill runs the prompt prefix every row shares (a chat template's system block: 24 of
SmolLM2's ~40 prompt tokens) once, at batch 1, and copies its KV cache to every row; each row's
rest then runs on top of it at the positions it has in the plain prefill (`prefill`).

Semantics follow `generate` with do_sample=True and the library's processors in its order:
stop tokens suppressed before `min_new_tokens`, then temperature, top-k, top-p (nucleus, at
least one token kept). Rows that stopped are fed the pad id and still attend (as in `generate`);
the loop ends when every row has stopped or after `max_new_tokens`. Log-probs are those of
softmax(logits / T) before top-k/top-p and min-tokens, as PPO's training forward computes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ppo_core.config import SamplingConfig
from ppo_core.lm.models import unwrap_peft
from ppo_core.lm.packing import first_real_column, position_ids_from_mask, shared_prefix_len

MIN_SHARED_PREFIX = 4
"""Shorter shared prefixes (a lone BOS) are prefilled with the rest: the batch-1 forward would
cost about what it saves."""


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
    params = inspect.signature(unwrap_peft(model).forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def forward(ids: torch.Tensor, attention: torch.Tensor, pos: torch.Tensor, past: Any) -> tuple[torch.Tensor, Any]:
        """[B, V] fp32 logits of the last position, and the KV cache."""
        out = model(input_ids=ids, attention_mask=attention, position_ids=pos, use_cache=True,
                    **{cache_arg: past}, **kwargs)
        return out.logits[:, -1].float(), getattr(out, cache_arg)

    with _contiguous_head_input(model):
        logits, cache, mask = prefill(forward, query_ids, mask, positions)
        for step in range(sampling.max_new_tokens):
            token = sample_categorical(warp_scores(logits, sampling, step, stops))
            if want_logprobs:
                logprobs.append(torch.log_softmax(logits / sampling.temperature, -1).gather(-1, token[:, None])[:, 0])
            token = torch.where(running, token, pad_id)
            tokens.append(token)
            running &= ~torch.isin(token, stops)
            if not running.any() or step + 1 == sampling.max_new_tokens:
                break
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits, cache = forward(token[:, None], mask, positions[:, -1:] + step + 1, cache)
    raw = torch.stack(tokens, dim=1)
    return raw, (torch.stack(logprobs, dim=1) if want_logprobs else None)


def prefill(
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, Any]],
    query_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """The prompt forward: the last prompt token's logits [B, V], the KV cache, and the attention
    mask the decode steps extend.

    With a shared prefix of p >= MIN_SHARED_PREFIX tokens the rows are laid out as
    [prefix | left pad | rest of the row]: the prefix runs once at batch 1, its cache is repeated
    for every row, then the rests run on top of it at their own positions (p, p+1, ...). Every
    token sees the same keys at the same positions as in the plain prefill: same math, p x (B - 1)
    fewer token forwards. `forward(ids, mask, positions, cache)` runs the model (cache None: a new one)."""
    batch, width = query_ids.shape
    p = shared_prefix_len(query_ids, mask, keep=1)
    if p < MIN_SHARED_PREFIX:
        return (*forward(query_ids, mask, positions, None), mask)
    starts = first_real_column(mask)
    head = slice(int(starts[0]), int(starts[0]) + p)  # row 0's prefix columns
    _, cache = forward(query_ids[:1, head], mask[:1, head], positions[:1, head], None)
    if not hasattr(cache, "batch_repeat_interleave"):  # a model without transformers' Cache
        return (*forward(query_ids, mask, positions, None), mask)
    cache.batch_repeat_interleave(batch)
    # column j of a row's rest: its own pad while j < its pad width, else the token p further on
    cols = torch.arange(width - p, device=mask.device).expand(batch, -1)
    cols = cols + p * (cols >= starts[:, None])
    rest_ids, rest_mask, rest_positions = (t.gather(1, cols) for t in (query_ids, mask, positions))
    mask = torch.cat([mask.new_ones(batch, p), rest_mask], dim=1)
    return (*forward(rest_ids, mask, rest_positions, cache), mask)


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
