"""Precision (ppo_core.lm.precision): what `auto` resolves to here, and bf16 training with fp32
master weights, which keeps updates smaller than bf16's resolution that bf16 weights alone lose."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ppo_core.config import DeviceConfig
from ppo_core.lm.attention import ATTENTION_NAME
from ppo_core.lm.placement import resolve_placement
from ppo_core.lm.precision import (
    MasterWeights,
    cpu_bf16_flags,
    prefer_eager_attention,
    resolve_precision,
)
from tests.tiny import tiny_llama

CPU = torch.device("cpu")


def test_auto_is_bf16_exactly_where_the_cpu_multiplies_bf16_natively() -> None:
    flags = set(re.findall(r"\b(amx_bf16|avx512_bf16)\b", Path("/proc/cpuinfo").read_text()))
    assert set(cpu_bf16_flags()) == flags
    dtype, reason = resolve_precision("auto", CPU)
    assert dtype == (torch.bfloat16 if flags else torch.float32)
    assert reason.startswith("precision: auto: ") and (all(f in reason for f in flags) if flags else "no native" in reason)
    assert resolve_precision("fp32", CPU) == (torch.float32, "precision: fp32 (as set)")
    assert resolve_precision("bf16", CPU)[0] == torch.bfloat16


def test_a_placement_freezes_models_in_its_dtype_and_keeps_trained_ones_fp32() -> None:
    where = resolve_placement(DeviceConfig(device="cpu", precision="bf16"))
    frozen, trained = nn.Linear(4, 4), nn.Linear(4, 4)
    params = list(frozen.parameters())
    assert where.freeze(frozen) is frozen and [id(p) for p in frozen.parameters()] == [id(p) for p in params]
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training
    assert {p.dtype for p in where.place(trained).parameters()} == {torch.float32}


def _fit(weights_dtype: torch.dtype, steps: int, lr: float) -> tuple[nn.Linear, MasterWeights]:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    weights = MasterWeights.cast(model, weights_dtype)
    opt = torch.optim.SGD(weights.master_params(), lr=lr)
    x = torch.randn(64, 8)
    y = x @ torch.arange(8.0)[:, None]
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for chunk_x, chunk_y in zip(x.split(32), y.split(32), strict=True):  # two micro-batches
            loss = ((model(chunk_x.to(weights_dtype)).float() - chunk_y) ** 2).sum() / 64
            loss.backward()
            weights.accumulate_grads()
        opt.step()
        weights.publish()
    return model, weights


def test_fp32_masters_train_bf16_weights_like_fp32_training() -> None:
    fp32, plain = _fit(torch.float32, 50, 0.01)
    bf16, mixed = _fit(torch.bfloat16, 50, 0.01)
    assert not plain.mixed and plain.master_params()[0] is fp32.weight  # fp32: a pass-through
    assert mixed.mixed and all(m.dtype == torch.float32 for m in mixed.master_params())
    assert bf16.weight.dtype == torch.bfloat16 and bf16.weight.grad is None  # gradients live on the masters
    # the bf16 weights are the rounded masters, and the masters follow the fp32 run closely
    assert torch.equal(bf16.weight, mixed.master_params()[0].detach().to(torch.bfloat16))
    torch.testing.assert_close(mixed.master_params()[0].detach(), fp32.weight.detach(), atol=0.05, rtol=0.02)


def test_updates_below_bf16_resolution_accumulate_in_the_masters() -> None:
    """A weight of 1.0 (bf16 spacing there: 2^-7) taking 100 steps of 1e-4: bf16 weights alone
    round every step back to 1.0; the fp32 master reaches 0.99, and the bf16 weight follows."""
    naive = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    module = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(1.0)
    weights = MasterWeights.cast(module, torch.bfloat16)
    for opt in (torch.optim.SGD([naive], lr=1e-4), torch.optim.SGD(weights.master_params(), lr=1e-4)):
        for _ in range(100):
            opt.zero_grad(set_to_none=True)
            if opt.param_groups[0]["params"][0] is naive:
                naive.sum().backward()
            else:
                module(torch.ones(1, 1, dtype=torch.bfloat16)).sum().backward()
                weights.accumulate_grads()
            opt.step()
            weights.publish()
    assert naive.item() == 1.0
    torch.testing.assert_close(weights.master_params()[0].item(), 0.99, atol=1e-5, rtol=0)  # fp32 sum of 100 steps
    assert module.weight.item() == torch.tensor(0.99).to(torch.bfloat16).item() < 1.0


def test_a_checkpoint_holds_the_fp32_masters_and_restores_them_exactly() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    weights = MasterWeights.cast(module, torch.bfloat16)
    with torch.no_grad():
        for master in weights.master_params():
            master.add_(1e-4)  # a step too small for bf16: only the masters know it
    weights.publish()
    state = weights.exact_state(module.state_dict(), module)
    assert {v.dtype for v in state.values()} == {torch.float32}
    assert all(torch.equal(state[k], m) for k, m in zip(dict(module.named_parameters()), weights.master_params(), strict=True))
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    restored = MasterWeights.cast(fresh, torch.bfloat16)
    fresh.load_state_dict(state)
    restored.load_exact_state(state, fresh)
    assert all(torch.equal(a, b) for a, b in zip(restored.master_params(), weights.master_params(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), module.parameters(), strict=True))


def test_trained_models_on_a_bf16_cpu_use_eager_attention_and_compute_the_same() -> None:
    """sdpa's CPU flash-attention backward is ~10x its forward in bf16: trained models switch to
    eager attention there (only there), and the logits stay those of sdpa."""
    model = tiny_llama(seed=0)
    assert model.config._attn_implementation == "sdpa"
    prefer_eager_attention(model, torch.device("cpu"), torch.float32)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = (ids != 0).long()
    before = model(input_ids=ids, attention_mask=mask).logits
    prefer_eager_attention(model, torch.device("cpu"), torch.bfloat16)
    assert model.config._attn_implementation == ATTENTION_NAME  # eager, one copy of the probabilities
    after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after[mask.bool()], before[mask.bool()], atol=1e-5, rtol=1e-5)
