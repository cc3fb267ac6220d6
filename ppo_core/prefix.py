"""Forward passes that compute a prompt prefix shared by every row once instead of B times.

Chat prompts start with the same template tokens (SmolLM2's default system prompt is 24 of its
~40 prompt tokens), and every scoring forward and every update epoch runs the transformer over
them again for each row. Their keys and values are the same in every row (same tokens, same
positions 0..p-1, causal attention never looks right), so we run the prefix once, repeat its
cache over the batch and feed each row only its remainder. Exact, gradients included: the
backward of the repeat sums the rows' gradients into the one prefix computation.

    rows:   [pad..pad | prefix (p) | rest of prompt | response | pad..pad]
    prefix: [prefix]                          -> cache (1 row, positions 0..p-1), repeated B times
    suffix: [pad..pad | rest of prompt | response | pad..pad]  with positions p, p+1, ...

Only for models whose cache is plain full attention (`DynamicLayer`); anything else (sliding
windows, hybrid caches, gradient checkpointing) takes the ordinary forward.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over real tokens; pads get 0 (they are masked out of attention anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


MIN_SHARED_PREFIX = 8
"""Below this many shared tokens the extra prefix call costs more than it saves."""


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int) -> int:
    """Length p of the token prefix every row starts with (after its left padding), capped so
    the prefix ends before the last `keep` columns, whose outputs the caller reads."""
    starts = first_real_column(attention_mask)
    limit = int((input_ids.shape[1] - keep - starts).min())
    if limit <= 0 or input_ids.shape[0] < 2:
        return 0
    cols = starts[:, None] + torch.arange(limit, device=input_ids.device)
    heads = input_ids.gather(1, cols)
    real = attention_mask.gather(1, cols).bool().all(0)
    same = (heads == heads[:1]).all(0) & real
    differs = (~same).nonzero()
    return int(differs[0]) if len(differs) else limit


def first_real_column(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's first attended token (its left padding's width)."""
    return attention_mask.long().argmax(dim=1)


def drop_prefix(tensor: torch.Tensor, starts: torch.Tensor, p: int) -> torch.Tensor:
    """Remove columns starts[b] .. starts[b]+p-1 from each row, keeping the left padding."""
    cols = torch.arange(tensor.shape[1] - p, device=tensor.device)[None, :]
    src = cols + p * (cols >= starts[:, None])
    return tensor.gather(1, src)


def _inner(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _trunk(model: nn.Module) -> nn.Module:
    """The transformer body without the LM head (peft's injected adapters live inside it)."""
    inner = _inner(model)
    return getattr(inner, inner.base_model_prefix, inner)


def supports_prefix_sharing(model: nn.Module) -> bool:
    """Checkpointed layers recompute their forward without a cache argument: no sharing."""
    return not any(
        getattr(m, "gradient_checkpointing", False) is True for m in _inner(model).modules()
    )


def cache_argument(model: nn.Module) -> str:
    """transformers 5.x renames `past_key_values` to `cache` (the old name is deprecated)."""
    return (
        "cache"
        if "cache" in inspect.signature(_inner(model).forward).parameters
        else "past_key_values"
    )


def prefix_cache(model: nn.Module, prefix_ids: torch.Tensor, batch: int) -> DynamicCache | None:
    """The prefix's keys/values for one row, repeated to `batch` rows (None if the model's
    cache is not plain full attention, so the caller falls back)."""
    positions = torch.arange(prefix_ids.shape[1], device=prefix_ids.device)[None, :]
    out = _trunk(model)(input_ids=prefix_ids, position_ids=positions, use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if not isinstance(cache, DynamicCache) or not all(
        type(layer) is DynamicLayer for layer in cache.layers
    ):
        return None
    cache.batch_repeat_interleave(batch)
    return cache


def forward_sharing_prefix(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    share_prefix: bool = True,
    **kwargs: Any,
) -> Any:
    """`model(...)` over left-padded rows, with the shared prefix computed once.

    The output covers only the suffix columns (the last `input_ids.shape[1] - p`); callers read
    the last `keep` positions of it, which are the same columns as in a plain forward.
    `kwargs` go to the model call over the rows (e.g. `logits_to_keep`, `output_hidden_states`).
    `share_prefix=False` (or a prefix under MIN_SHARED_PREFIX tokens) is the plain forward.
    """
    starts = first_real_column(attention_mask)
    p = (
        shared_prefix_len(input_ids, attention_mask, keep)
        if share_prefix and supports_prefix_sharing(model)
        else 0
    )
    cache = None
    if p >= MIN_SHARED_PREFIX:
        first = int(starts[0])
        cache = prefix_cache(model, input_ids[:1, first : first + p], input_ids.shape[0])
    if cache is None:
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            **kwargs,
        )
    suffix_ids = drop_prefix(input_ids, starts, p)
    suffix_mask = drop_prefix(attention_mask, starts, p)
    full_mask = torch.cat([suffix_mask.new_ones(suffix_mask.shape[0], p), suffix_mask], dim=1)
    return model(
        input_ids=suffix_ids,
        attention_mask=full_mask,
        position_ids=position_ids_from_mask(suffix_mask) + p,
        use_cache=False,
        **{cache_argument(model): cache},
        **kwargs,
    )
