"""Per-token log-probabilities of sampled tokens, and the forward passes that produce them.

Sequences are [left-padded prompt | right-padded response]. Three details matter:
- position ids come from the attention mask, so a prompt's tokens get the same positions
  whatever padding sits to its left (padding invariance);
- logits are divided by the sampling temperature before the softmax, so pi_theta is the
  distribution the tokens were actually drawn from;
- the log-softmax is never materialised for the whole batch: we gather the sampled logit
  and subtract a logsumexp, a chunk of rows at a time, in fp32; for the backward only the
  logits as the model produced them are kept (bf16 ones are not kept a second time in fp32).
"""

from __future__ import annotations

import torch
from torch import nn

from ppo_core.lm.packing import position_ids_from_mask, response_states
from ppo_core.ppo.losses import entropy_from_logits

__all__ = [
    "log_softmax_and_entropy", "position_ids_from_mask", "response_logits", "response_logprobs",
    "selective_log_softmax",
]


def _row_chunks(logits: torch.Tensor, index: torch.Tensor, chunk_size: int):
    """(logit rows [c, V] in the logits' dtype, their sampled indices [c]) for chunks of at most
    chunk_size rows; one empty chunk for no rows."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_index = index.reshape(-1)
    for start in range(0, max(flat_logits.shape[0], 1), chunk_size):
        yield flat_logits[start : start + chunk_size], flat_index[start : start + chunk_size]


def _picked(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return rows.gather(-1, index[:, None]).squeeze(-1)


def _fp32_logprobs(rows: torch.Tensor, index: torch.Tensor, with_entropy: bool):
    """(log softmax[index], entropy or an empty tensor, logsumexp) of one chunk, from one fp32 copy."""
    full = rows.float()
    lse = torch.logsumexp(full, dim=-1)
    entropy = entropy_from_logits(full, lse) if with_entropy else lse.new_empty(0)
    return _picked(full, index) - lse, entropy, lse


class _PickedLogSoftmax(torch.autograd.Function):
    """(log softmax(rows)[index], the rows' entropy or an empty tensor), fp32, from logit rows
    [c, V] in any float dtype. Saves the rows as they come (bf16: half the bytes of the fp32 copy
    autograd would keep for logsumexp) and their logsumexp; the backward reads the rows in fp32
    again and computes what autograd computes through logsumexp and gather, bit for bit, with one
    fp32 [c, V] buffer: d/d rows = onehot(index) * g - softmax(rows) * g. The entropy gets no
    gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, with_entropy: bool):
        logprobs, entropy, lse = _fp32_logprobs(rows, index, with_entropy)
        ctx.save_for_backward(rows, index, lse)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _entropy_grad: torch.Tensor):
        rows, index, lse = ctx.saved_tensors
        grad_rows = (rows - lse.unsqueeze(-1)).exp_()  # fp32: bf16 rows are promoted exactly, no copy
        grad_rows.mul_((-grad).unsqueeze(-1)).scatter_add_(-1, index[:, None], grad[:, None])
        return grad_rows.to(rows.dtype), None, None


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, chunk_size: int = 4096
) -> torch.Tensor:
    """log softmax(logits)[index] along the last dim in fp32, chunked over rows to bound memory."""
    picked = [_PickedLogSoftmax.apply(rows, i, False)[0] for rows, i in _row_chunks(logits, index, chunk_size)]
    return torch.cat(picked).view(index.shape)


def log_softmax_and_entropy(
    logits: torch.Tensor, index: torch.Tensor, chunk_size: int = 4096, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """selective_log_softmax and the entropy of the same rows from one fp32 copy and one
    logsumexp per chunk. Without `entropy_grad` (ent_coef = 0: the entropy is only logged) the
    entropy is computed without autograd; the log-probs keep theirs."""
    logprobs, entropy = [], []
    for rows, i in _row_chunks(logits, index, chunk_size):
        if entropy_grad and torch.is_grad_enabled():  # autograd through both
            chunk_logprobs, chunk_entropy, _ = _fp32_logprobs(rows, i, True)
        else:
            chunk_logprobs, chunk_entropy = _PickedLogSoftmax.apply(rows, i, True)
        logprobs.append(chunk_logprobs)
        entropy.append(chunk_entropy)
    return torch.cat(logprobs).view(index.shape), torch.cat(entropy).view(index.shape)


def response_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    packed: bool = True,
) -> torch.Tensor:
    """Logits predicting each response token, [batch, response_len, vocab], already / temperature.

    Only the last response_len + 1 positions go through the LM head; with `packed` the rows
    run without pads and with their shared prompt prefix once (ppo_core.lm.packing).
    """
    logits, _ = response_states(model, input_ids, attention_mask, response_len + 1, True, packed, hidden=False)
    logits = logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    packed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens (the last response_len columns of input_ids), and the
    temperature-scaled logits they came from (the trainer's own forwards take the entropy from
    log_softmax_and_entropy instead)."""
    logits = response_logits(model, input_ids, attention_mask, response_len, temperature, packed)
    tokens = input_ids[:, -response_len:]
    return selective_log_softmax(logits, tokens, chunk_size), logits
