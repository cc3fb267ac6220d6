"""Forwards over packed rows: no pad tokens, and the prompt prefix all rows share computed once.

A PPO batch is a rectangle [left pad | prompt | response | right pad]. The plain forward pays
for every cell, pads included, and for the chat template's header (SmolLM2's default system
prompt is 24 of its ~40 prompt tokens) once per row, in scoring and in every update epoch.
Packing lays the real tokens of several rows end to end in one sequence, behind one copy of
the shared prefix, and gives attention a block mask:

    packed row:  [prefix (p) | rest of row 3 | rest of row 5 | rest of row 6 | pad]
    a token of row 5 sees: the prefix, and the earlier tokens of row 5; nothing else.

Positions restart after the prefix for each row (p, p+1, ...), so every token sees the same
keys at the same positions as in the plain forward: same math, and one weight-gradient GEMM
per layer for the whole batch. Attention over a packed row costs O(length^2), so rows are
spread over packed rows of about `hidden_size` tokens each (see `pack_budget`), each with its
own copy of the prefix.

Only where it is exact: attention implementations that take a 4D mask (sdpa, eager, ppo_core's),
no sliding window, and an LM head that is a plain projection of the trunk's last hidden state
(checked once per model on a 4-token input). Anything else takes the plain forward. Gradient
checkpointing keeps packing: a checkpointed layer is recomputed with the arguments of its first
call, the block mask and positions included (tests/test_packing.py checks the gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ppo_core.lm.attention import ATTENTION_NAME
from ppo_core.lm.models import trunk, unwrap_peft

HEAD_CHECK_ATTR = "_ppo_core_plain_head"
ADDITIVE_MASK_ATTENTION = ("eager", ATTENTION_NAME)  # take the block mask as bias added to the scores


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over real tokens; pads get 0 (they are masked out of attention anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def first_real_column(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's first attended token (its left padding's width)."""
    return attention_mask.long().argmax(dim=1)


def end_column(attention_mask: torch.Tensor) -> torch.Tensor:
    """One past each row's last attended token (where its right padding starts)."""
    return attention_mask.shape[1] - attention_mask.long().flip(1).argmax(dim=1)


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int) -> int:
    """Length p of the token prefix every row starts with (after its left padding), capped so
    the prefix ends before the last `keep` columns, whose outputs the caller reads."""
    starts = first_real_column(attention_mask)
    limit = int((input_ids.shape[1] - keep - starts).min())
    if limit <= 0 or input_ids.shape[0] < 2:
        return 0
    cols = starts[:, None] + torch.arange(limit, device=input_ids.device)
    heads = input_ids.gather(1, cols)
    same = (heads == heads[:1]).all(0)
    differs = (~same).nonzero()
    return int(differs[0]) if len(differs) else limit


def bin_rows(lengths: list[int], prefix: int, budget: int) -> list[list[int]]:
    """Rows spread over as few packed rows as keep each near `budget` tokens (prefix + rows):
    longest row first into the emptiest bin, so the bins end up about equally long and the
    padding of the shorter ones to the longest stays small."""
    total = sum(lengths)
    n_bins = max(1, min(len(lengths), math.ceil(total / max(budget - prefix, 1))))
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    sizes = [0] * n_bins
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        k = sizes.index(min(sizes))
        bins[k].append(row)
        sizes[k] += lengths[row]
    return [sorted(rows) for rows in bins if rows]


@dataclass
class Packing:
    """Where each row's tokens went: the packed inputs, and for every (row, kept column) the
    flat index of its packed position, so outputs can be gathered back onto the batch grid."""

    input_ids: torch.Tensor  # [K, W]
    position_ids: torch.Tensor  # [K, W]
    segment: torch.Tensor  # [K, W]: -1 prefix, -2 filler, b = row b
    index: torch.Tensor  # [B, keep] into the flattened [K * W]

    def attention_mask(self, additive: torch.dtype | None = None) -> torch.Tensor:
        """[K, 1, W, W]: causal, within a row's own tokens or onto the prefix; filler sees only
        itself (a query that sees nothing would make softmax NaN). Boolean (True = attend, what
        sdpa takes), or additive in `additive` dtype (what eager attention adds to scores)."""
        width = self.segment.shape[1]
        q, k = self.segment[:, :, None], self.segment[:, None, :]
        causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=q.device)
        allowed = ((causal & ((q == k) | (k == -1)) & (q != -2)) | eye)[:, None]
        if additive is None:
            return allowed
        mask = torch.zeros(allowed.shape, dtype=additive, device=q.device)
        return mask.masked_fill(~allowed, torch.finfo(additive).min)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int, budget: int) -> Packing:
    """Lay each row's real tokens after one shared prefix per bin (see the module docstring).
    Kept columns past a row's end (its right padding) point at its last real token: the
    caller masks them, as it masks pads in the plain forward."""
    batch, width = input_ids.shape
    device = input_ids.device
    starts, ends = first_real_column(attention_mask).tolist(), end_column(attention_mask).tolist()
    p = shared_prefix_len(input_ids, attention_mask, keep)
    lengths = [e - s - p for s, e in zip(starts, ends, strict=True)]
    bins = bin_rows(lengths, p, budget)
    packed_width = max(p + sum(lengths[b] for b in rows) for rows in bins)
    ids = torch.zeros(len(bins), packed_width, dtype=input_ids.dtype, device=device)
    pos = torch.zeros_like(ids)
    seg = torch.full_like(ids, -2)
    index = torch.zeros(batch, keep, dtype=torch.long, device=device)
    kept_cols = torch.arange(width - keep, width, device=device)
    for k, rows in enumerate(bins):
        ids[k, :p] = input_ids[0, starts[0] : starts[0] + p]
        pos[k, :p] = torch.arange(p, device=device)
        seg[k, :p] = -1
        at = p
        for b in rows:
            begin, n = starts[b] + p, lengths[b]
            ids[k, at : at + n] = input_ids[b, begin : begin + n]
            pos[k, at : at + n] = torch.arange(p, p + n, device=device)
            seg[k, at : at + n] = b
            index[b] = k * packed_width + at + kept_cols.clamp(max=ends[b] - 1) - begin
            at += n
    return Packing(ids, pos, seg, index)


def has_lm_head(model: nn.Module) -> bool:
    return trunk(model) is not unwrap_peft(model)


def can_pack(model: nn.Module) -> bool:
    config = unwrap_peft(model).config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", *ADDITIVE_MASK_ATTENTION):
        return False
    if getattr(config, "sliding_window", None) or (getattr(config, "layer_types", None) and any(
        t != "full_attention" for t in config.layer_types
    )):
        return False
    return not has_lm_head(model) or plain_head(model)


def plain_head(model: nn.Module) -> bool:
    """Whether logits == output_embeddings(trunk hidden state) for this model (no softcapping,
    logit scaling or other post-processing we would skip); checked once and remembered."""
    if HEAD_CHECK_ATTR not in model.__dict__:
        device = next(model.parameters()).device
        ids = torch.arange(1, 5, device=device)[None, :]
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            hidden = trunk(model)(input_ids=ids, use_cache=False).last_hidden_state
            ours = unwrap_peft(model).get_output_embeddings()(hidden)
        model.__dict__[HEAD_CHECK_ATTR] = bool(torch.allclose(logits, ours, atol=1e-5, rtol=1e-4))
    return model.__dict__[HEAD_CHECK_ATTR]


def pack_budget(model: nn.Module, longest: int) -> int:
    """Tokens per packed row: the model's hidden size, or the longest row if that is longer.
    Per token, attention over a packed row costs in proportion to the row's length and the linear
    layers in proportion to the hidden size, so this budget keeps the first from outgrowing the
    second (measurements: tests/bench/README.md)."""
    return max(longest, int(unwrap_peft(model).config.hidden_size))


def response_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    logits: bool,
    packed: bool = True,
    hidden: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, final hidden states) at the last `keep` columns, [B, keep, ...]; each None
    unless asked for (a bare trunk has no logits; packed forwards always return hidden).

    Logits are only computed there: the prompt's next-token logits are never needed, and on a
    49k vocabulary they are a large share of the forward's FLOPs. `packed=False`, or a model
    packing cannot serve exactly, takes the plain forward over the padded rectangle.
    """
    if not (packed and can_pack(model)):
        return _plain_states(model, input_ids, attention_mask, keep, logits, hidden)
    longest = int((end_column(attention_mask) - first_real_column(attention_mask)).max())
    plan = pack(input_ids, attention_mask, keep, pack_budget(model, longest))
    eager = unwrap_peft(model).config._attn_implementation in ADDITIVE_MASK_ATTENTION
    out = trunk(model)(
        input_ids=plan.input_ids,
        attention_mask=plan.attention_mask(next(model.parameters()).dtype if eager else None),
        position_ids=plan.position_ids,
        use_cache=False,
    )
    flat = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
    states = flat[plan.index.reshape(-1)].view(*plan.index.shape, -1)
    head_logits = unwrap_peft(model).get_output_embeddings()(states) if logits else None
    return head_logits, states


def _plain_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    logits: bool,
    hidden: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    head = has_lm_head(model)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **({"logits_to_keep": keep, "output_hidden_states": hidden} if head else {}),
    )
    if not head:
        return None, out.last_hidden_state[:, -keep:]
    states = out.hidden_states[-1][:, -keep:] if hidden else None
    return (out.logits if logits else None), states
