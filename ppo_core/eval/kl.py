"""Per-sequence KL(pi || pi_ref) of a rollout, exact and sampled, from one forward of each model.

The sequence KL is reported three ways, all sums over the response tokens of one sequence:

    exact  = sum_t KL(pi(.|s_t) || pi_ref(.|s_t))
           = sum_t sum_a pi(a|s_t) (log pi(a|s_t) - log pi_ref(a|s_t))   over the full vocabulary
    k1     = sum_t log r_t,     k3 = sum_t (r_t^-1 - 1) + log r_t,     r_t = pi(a_t|s_t) / pi_ref(a_t|s_t)

All three have the same expectation over responses y ~ pi (the sequence KL of Ziegler et al.
2019); `exact` removes the per-token sampling noise of the actions, which is why it is the
default for the KL budget. Distributions are taken at the sampling temperature and without
top-k / top-p truncation, the same convention as the trainer's KL leash; with truncated
sampling the sampled estimators are biased and only `exact` keeps its meaning.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ppo_core.lm.logprobs import response_logits
from ppo_core.lm.masked import masked_sum
from ppo_core.lm.models import module_device
from ppo_core.lm.rollout import Rollout
from ppo_core.ppo.kl import kl_estimate


class SequenceKL(NamedTuple):
    """Per-sequence KL to the reference, [B] each (see the module docstring)."""

    exact: torch.Tensor
    k1: torch.Tensor
    k3: torch.Tensor


@torch.no_grad()
def sequence_kl(
    policy: nn.Module,
    ref: nn.Module,
    rollout: Rollout,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> SequenceKL:
    """Exact, k1 and k3 sequence KL from one forward pass of each model.

    The two [B, R, V] logit tensors are turned into log-softmaxes `chunk_size` token rows at a
    time, so the extra memory is O(chunk_size * V) on top of the logits themselves; bound the
    logits by passing fewer rows (`evaluate_policy` does, `batch_size` at a time).
    """
    ids, am, n = rollout.input_ids, rollout.attention_mask, rollout.response_len
    logits = response_logits(
        policy, ids.to(module_device(policy)), am.to(module_device(policy)), n, temperature
    )
    ref_logits = response_logits(ref, ids.to(module_device(ref)), am.to(module_device(ref)), n, temperature)
    ref_logits = ref_logits.to(logits.device)
    vocab = min(logits.shape[-1], ref_logits.shape[-1])  # padded LM heads: compare the real vocab
    flat, flat_ref = (
        logits[..., :vocab].reshape(-1, vocab),
        ref_logits[..., :vocab].reshape(-1, vocab),
    )
    tokens = rollout.response_ids.to(logits.device).reshape(-1)
    exact = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
    logp_tok, logq_tok = torch.empty_like(exact), torch.empty_like(exact)
    for start in range(0, tokens.shape[0], chunk_size):
        rows, picked = slice(start, start + chunk_size), tokens[start : start + chunk_size, None]
        logp = torch.log_softmax(flat[rows].float(), dim=-1)
        logq = torch.log_softmax(flat_ref[rows].float(), dim=-1)
        # KL(p || q) = sum_a p_a (log p_a - log q_a), over the whole vocabulary
        exact[rows] = (logp.exp() * (logp - logq)).sum(-1)
        logp_tok[rows] = logp.gather(-1, picked).squeeze(-1)
        logq_tok[rows] = logq.gather(-1, picked).squeeze(-1)
    mask = rollout.response_mask.to(logits.device)
    logp_tok, logq_tok = logp_tok.view(mask.shape), logq_tok.view(mask.shape)
    return SequenceKL(
        exact=masked_sum(exact.view(mask.shape), mask, dim=1),
        k1=masked_sum(kl_estimate(logp_tok, logq_tok, "k1"), mask, dim=1),
        k3=masked_sum(kl_estimate(logp_tok, logq_tok, "k3"), mask, dim=1),
    )

