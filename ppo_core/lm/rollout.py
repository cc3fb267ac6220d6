"""Batched sampling of responses, truncated at the first stop token.

A rollout is a rectangle [left-padded prompt | right-padded response]. The response mask
covers every token up to and including the first stop token (EOS or a configured stop id);
everything after it is replaced by the pad id and never enters a loss, a reward or a forward
pass (`Rollout.trimmed` drops columns that are pad in every row).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import torch
from torch import nn
from transformers import GenerationConfig

from ppo_core.config import SamplingConfig
from ppo_core.lm.logprobs import selective_log_softmax
from ppo_core.lm.models import unwrap_peft

# Keeping generation logits costs batch * new_tokens * vocab floats; above this many bytes we
# let the caller recompute log-probs with a forward pass instead.
GENERATION_LOGITS_BUDGET_BYTES = 1 << 30


@dataclass
class Rollout:
    """One batch of sampled responses and their masks. All tensors share the batch dimension."""

    query_ids: torch.Tensor
    """[B, P] prompt token ids, left-padded."""
    query_mask: torch.Tensor
    """[B, P] 1 on real prompt tokens."""
    response_ids: torch.Tensor
    """[B, R] response token ids, pad after the first stop token."""
    response_mask: torch.Tensor
    """[B, R] 1 on response tokens up to and including the first stop token."""
    ended: torch.Tensor
    """[B] True where the response emitted a stop token."""
    logprobs: torch.Tensor | None = None
    """[B, R] log pi(a_t|s_t) at the sampling temperature, from the generation logits (or None)."""
    prompt_index: torch.Tensor | None = None
    """[B] index of each row's prompt in the caller's prompt list, so scorers can read the raw
    prompt text rather than decoding a chat-templated query."""

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.query_mask, self.response_mask], dim=1).long()

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]

    def select(self, index: torch.Tensor | slice) -> Rollout:
        """The rows at `index`."""
        return Rollout(**{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    def trimmed(self) -> Rollout:
        """Drop prompt columns that are pad in every row and response columns past the longest
        response, so no forward or backward ever runs over them."""
        first = int(self.query_mask.any(0).long().argmax()) if self.query_mask.any() else 0
        length = int(self.response_mask.sum(1).max()) if self.response_mask.numel() else 0
        length = max(length, 1)
        return replace(
            self,
            query_ids=self.query_ids[:, first:],
            query_mask=self.query_mask[:, first:],
            response_ids=self.response_ids[:, :length],
            response_mask=self.response_mask[:, :length],
            logprobs=None if self.logprobs is None else self.logprobs[:, :length],
        )


def _take(value: torch.Tensor | None, index: torch.Tensor | slice) -> torch.Tensor | None:
    return None if value is None else value[index]


def truncate_after_stop(
    response_ids: torch.Tensor, stop_ids: Sequence[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad everything after each row's first stop token.

    Returns (response_ids, mask, ended): the mask includes the stop token itself, because
    the decision to stop is an action the policy must get credit for.
    """
    is_stop = torch.zeros_like(response_ids, dtype=torch.bool)
    for stop in stop_ids:
        is_stop |= response_ids == stop
    ended = is_stop.any(dim=1)
    # number of stop tokens strictly before position t; the first stop has 0 before it
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    mask = stops_before == 0
    response_ids = torch.where(mask, response_ids, torch.full_like(response_ids, pad_id))
    return response_ids, mask.long(), ended


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists into a left-padded [B, P] batch and its attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, width - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def generation_config(
    sampling: SamplingConfig, stop_ids: Sequence[int], pad_id: int, keep_logits: bool = False
) -> GenerationConfig:
    """A complete GenerationConfig, so that a model's own generation defaults never leak in."""
    return GenerationConfig(
        do_sample=True,
        max_new_tokens=sampling.max_new_tokens,
        min_new_tokens=sampling.min_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        eos_token_id=list(stop_ids),
        pad_token_id=pad_id,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=keep_logits,
    )


@torch.no_grad()
def generate(
    model: nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    sampling: SamplingConfig,
    stop_ids: Sequence[int],
    pad_id: int,
    want_logprobs: bool = True,
    chunk_size: int = 4096,
) -> Rollout:
    """Sample one response per prompt with the KV cache; see the module docstring for masks."""
    if not stop_ids:
        raise ValueError("generate needs at least one stop token id (the tokenizer's EOS)")
    device = next(model.parameters()).device
    query_ids, query_mask = query_ids.to(device), query_mask.to(device)
    budget = query_ids.shape[0] * sampling.max_new_tokens * _vocab_size(model) * 4
    keep_logits = want_logprobs and budget <= GENERATION_LOGITS_BUDGET_BYTES
    with _without_model_generation_defaults(model):
        out = model.generate(
            input_ids=query_ids,
            attention_mask=query_mask,
            generation_config=generation_config(sampling, stop_ids, pad_id, keep_logits),
        )
    raw = out.sequences[:, query_ids.shape[1] :]
    response_ids, response_mask, ended = truncate_after_stop(raw, stop_ids, pad_id)
    logprobs = None
    if keep_logits:
        logits = torch.stack(out.logits, dim=1) / sampling.temperature
        logprobs = selective_log_softmax(logits, raw, chunk_size) * response_mask
    return Rollout(query_ids, query_mask, response_ids, response_mask, ended, logprobs)


@contextmanager
def _without_model_generation_defaults(model: nn.Module) -> Iterator[None]:
    """transformers fills every field our GenerationConfig leaves None (suppress_tokens,
    repetition_penalty, no_repeat_ngram_size, num_beams, ...) from model.generation_config; any of
    them would make the sampling distribution differ from the softmax(logits / T) whose log-probs
    PPO trains on. A blank model config for the call leaves only the library's own settings."""
    base = unwrap_peft(model)
    saved = getattr(base, "generation_config", None)
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


def _vocab_size(model: nn.Module) -> int:
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is not None:
        return int(embeddings.weight.shape[0])
    return int(model.config.vocab_size)
