"""Sampling one decoded response per encoded prompt, a batch at a time: the loop shared by
preference collection (`ppo_core.data.labelers`) and held-out evaluation (`ppo_core.eval`).

The draws come from the torch RNG as the caller left it: seeding (or forking the RNG first, to
leave the caller's state alone) is the caller's choice, so each caller's stream of draws is
its own. Texts are decoded without special tokens and without stripping whitespace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ppo_core.config import SamplingConfig
from ppo_core.lm.models import eval_mode, stop_token_ids
from ppo_core.lm.rollout import Rollout, generate, left_pad


class SampledResponses(NamedTuple):
    """One entry per prompt, in the order the prompts were given."""

    texts: list[str]
    """Decoded response, special tokens skipped, whitespace kept."""
    lengths: list[float]
    """Response length in tokens, the stop token included."""
    ended: list[float]
    """1.0 where the response emitted a stop token before max_new_tokens, else 0.0."""


@torch.no_grad()
def sample_responses(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    batch_size: int = 16,
    on_batch: Callable[[Rollout], None] | None = None,
    progress: str | None = None,
) -> SampledResponses:
    """One sampled response per token list, `batch_size` prompts per `generate` call, with the
    model in eval mode. `on_batch` sees each batch's trimmed rollout as soon as it is sampled
    (evaluation computes the batch's KL to the reference there); `progress` names a progress
    bar over the batches (None: no bar)."""
    stops = stop_token_ids(tokenizer, sampling.stop_token_ids)
    if not stops:
        raise ValueError("sampling needs at least one stop token id (the tokenizer's EOS)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    starts = range(0, len(prompt_ids), batch_size)
    out = SampledResponses([], [], [])
    with eval_mode(model):
        for start in tqdm(starts, desc=progress, unit="batch") if progress else starts:
            query_ids, query_mask = left_pad(prompt_ids[start : start + batch_size], pad)
            rollout = generate(
                model, query_ids, query_mask, sampling, stops, pad, want_logprobs=False
            ).trimmed()
            for ids, mask in zip(rollout.response_ids, rollout.response_mask, strict=True):
                out.texts.append(
                    tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                )
            out.lengths.extend(rollout.response_mask.sum(1).float().tolist())
            out.ended.extend(rollout.ended.float().tolist())
            if on_batch is not None:
                on_batch(rollout)
    return out
