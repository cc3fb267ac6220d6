"""Batched sampling of responses, truncated at the first stop token.

A rollout is a rectangle [left-padded prompt | right-padded response]. The response mask
covers every token up to and including the first stop token (EOS or a configured stop id);
everything after it is replaced by the pad id and never enters a loss, a reward or a forward
pass (`Rollout.trimmed` drops columns that are pad in every row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from ppo_core.config import SamplingConfig
from ppo_core.lm.decoding import decode


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
    """[B, R] log pi(a_t|s_t) at the sampling temperature, taken while sampling (or None)."""
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


@torch.no_grad()
def generate(
    model: nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    sampling: SamplingConfig,
    stop_ids: Sequence[int],
    pad_id: int,
    want_logprobs: bool = True,
) -> Rollout:
    """Sample one response per prompt with the KV cache (ppo_core.lm.decoding); see the module
    docstring for masks."""
    if not stop_ids:
        raise ValueError("generate needs at least one stop token id (the tokenizer's EOS)")
    device = next(model.parameters()).device
    query_ids, query_mask = query_ids.to(device), query_mask.to(device)
    raw, logprobs = decode(model, query_ids, query_mask, sampling, stop_ids, pad_id, want_logprobs)
    response_ids, response_mask, ended = truncate_after_stop(raw, stop_ids, pad_id)
    if logprobs is not None:
        logprobs = logprobs * response_mask
    return Rollout(query_ids, query_mask, response_ids, response_mask, ended, logprobs)
