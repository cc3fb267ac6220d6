"""Eager attention for bf16 training on a CPU that keeps one copy of the probabilities, not two.

transformers' eager attention for Llama-style decoders computes, per layer and head,

    P = softmax(Q K^T * scaling + M)   in fp32, then cast to bf16;   O = P_bf16 V

and autograd keeps both P (fp32, for the softmax backward) and P_bf16 (for the matmul backward):
6 bytes per probability. `softmax_times_values` computes the same forward but keeps only the
fp32 P and casts it to bf16 again in the backward, where the matmul needs it (the cast is exact
and deterministic): 4 bytes, the same gradients bit for bit (tests/test_attention.py), at the cost
of one cast per probability in the backward (measured: tests/bench/README.md, "Attention").

`PLAIN_EAGER_MODEL_TYPES` lists the model types whose own eager attention is exactly that formula
(a test compares their source with Llama's, so a transformers upgrade that changes one fails it);
other models keep their own eager attention.
"""

from __future__ import annotations

import torch
from torch import nn

ATTENTION_NAME = "ppo_core_attention"
PLAIN_EAGER_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3"})

__all__ = ["ATTENTION_NAME", "PLAIN_EAGER_MODEL_TYPES", "attention_forward", "register", "softmax_times_values"]


class _SoftmaxTimesValues(torch.autograd.Function):
    """softmax(scores) in fp32, cast to the values' dtype, times values; saves the fp32 P only."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float(), dim=-1)
        ctx.save_for_backward(probs, values)
        ctx.scores_dtype = scores.dtype
        return torch.matmul(probs.to(values.dtype), values)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, values = ctx.saved_tensors
        grad_values = torch.matmul(probs.to(values.dtype).transpose(-2, -1), grad_out)
        grad_probs = torch.matmul(grad_out, values.transpose(-2, -1)).float()
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, torch.float32)
        return grad_scores.to(ctx.scores_dtype), grad_values


def softmax_times_values(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(scores, fp32).to(values.dtype) @ values. scores [B, H, Lq, Lk], values [B, H, Lk, D]
    -> [B, H, Lq, D]."""
    return _SoftmaxTimesValues.apply(scores, values)


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, L, D] -> [B, kv_heads * groups, L, D] (grouped-query attention)."""
    if groups == 1:
        return states
    b, kv_heads, length, dim = states.shape
    return states[:, :, None].expand(b, kv_heads, groups, length, dim).reshape(b, kv_heads * groups, length, dim)


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; query [B, H, Lq, D], key/value [B, kv_heads, Lk, D],
    an additive mask [B, 1, Lq, Lk] -> ([B, Lq, H, D], no weights). Attention dropout is refused:
    `prefer_eager_attention` only picks this for models without it."""
    if dropout and module.training:
        raise ValueError(f"{ATTENTION_NAME} does not implement attention dropout ({dropout})")
    groups = query.shape[1] // key.shape[1]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, _repeat_kv(key, groups).transpose(2, 3)) * scale
    if attention_mask is not None:
        scores = scores + attention_mask
    out = softmax_times_values(scores, _repeat_kv(value, groups))
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ATTENTION_NAME a transformers attention implementation (with eager's additive mask);
    idempotent. Returns the name for `set_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
        eager_mask,
    )

    if ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTENTION_NAME, attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
    return ATTENTION_NAME
