"""ppo_core.lm.attention: transformers' eager attention, bit for bit, with one copy of the
probabilities saved for the backward instead of two."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from transformers import BertConfig, BertModel

from ppo_core.lm.attention import (
    ATTENTION_NAME,
    PLAIN_EAGER_MODEL_TYPES,
    attention_forward,
    register,
)
from ppo_core.lm.packing import response_states
from ppo_core.lm.precision import prefer_eager_attention
from tests.conftest import build_trainer
from tests.tiny import tiny_llama

# left-padded rows sharing a 3-token prefix: the plain forward masks pads, the packed one packs rows
IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13, 14, 15], [0, 5, 6, 7, 9, 9, 8, 16]])
MASK = (IDS != 0).long()
KEEP = 4  # positions whose logits the PPO forward reads (response + 1)


def _bf16_llama(implementation: str) -> torch.nn.Module:
    model = tiny_llama(seed=3, layers=3).to(torch.bfloat16)
    model.set_attn_implementation(register() if implementation == ATTENTION_NAME else implementation)
    return model.train()


def _loss(model: torch.nn.Module, packed: bool) -> torch.Tensor:
    logits, _ = response_states(model, IDS, MASK, KEEP, logits=True, packed=packed, hidden=False)
    weights = torch.linspace(-1.0, 1.0, logits.numel()).view_as(logits)
    return (logits.float() * weights).sum()


def saved_tensor_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves while `fn` runs its forward."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_same_logits_and_gradients_as_transformers_eager_attention_bit_for_bit(packed: bool) -> None:
    eager, ours = _bf16_llama("eager"), _bf16_llama(ATTENTION_NAME)
    loss_eager, loss_ours = _loss(eager, packed), _loss(ours, packed)
    assert torch.equal(loss_eager, loss_ours)
    loss_eager.backward()
    loss_ours.backward()
    for (name, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name


def test_saves_the_fp32_probabilities_and_not_their_bf16_copy() -> None:
    """Each layer's eager attention keeps P in fp32 (4 bytes) and in bf16 (2 bytes); ours only the
    fp32 one: 2 bytes less per probability, [rows, heads, L, L] per layer."""
    eager, ours = _bf16_llama("eager"), _bf16_llama(ATTENTION_NAME)
    saved_eager = saved_tensor_bytes(lambda: _loss(eager, packed=False))
    saved_ours = saved_tensor_bytes(lambda: _loss(ours, packed=False))
    rows, length = IDS.shape
    config = eager.config
    bf16_copies = config.num_hidden_layers * rows * config.num_attention_heads * length * length * 2
    assert saved_eager - saved_ours == bf16_copies


def test_model_types_listed_as_plain_have_llamas_eager_attention() -> None:
    """A transformers upgrade that changes one of these models' eager attention (softcapping,
    sinks, ...) fails here instead of silently computing something else."""

    def source(model_type: str) -> str:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        return inspect.getsource(module.eager_attention_forward)

    llama = source("llama")
    assert "softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)" in llama
    for model_type in PLAIN_EAGER_MODEL_TYPES:
        assert source(model_type) == llama, model_type


def test_prefer_eager_attention_picks_ours_only_for_plain_decoders_without_attention_dropout() -> None:
    cpu = torch.device("cpu")
    plain = tiny_llama(seed=0)
    prefer_eager_attention(plain, cpu, torch.bfloat16)
    assert plain.config._attn_implementation == ATTENTION_NAME
    with_dropout = tiny_llama(seed=0)
    with_dropout.config.attention_dropout = 0.1
    prefer_eager_attention(with_dropout, cpu, torch.bfloat16)
    assert with_dropout.config._attn_implementation == "eager"
    bert = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    prefer_eager_attention(bert, cpu, torch.bfloat16)
    assert bert.config._attn_implementation == "eager"


def test_attention_dropout_in_training_is_refused() -> None:
    module = torch.nn.Module().train()
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="attention dropout"):
        attention_forward(module, q, q, q, None, dropout=0.1)
    out, weights = attention_forward(module.eval(), q, q, q, None, dropout=0.1)
    assert out.shape == (1, 3, 2, 4) and weights is None


def test_ppo_in_bf16_trains_the_same_weights_as_with_transformers_eager_attention() -> None:
    """Two PPO iterations (rollout, scoring, two epochs of packed updates, separate critic) end on
    the same policy and critic weights bit for bit whichever eager attention the trainer uses."""

    def trained(implementation: str | None) -> list[torch.Tensor]:
        trainer = build_trainer(precision="bf16", critic="separate")
        models = [m for t in (trainer.policy, trainer.critic) for m in t.modules() if hasattr(m, "set_attn_implementation")]
        assert models and {m.config._attn_implementation for m in models} == {ATTENTION_NAME}
        for model in models if implementation is not None else []:
            model.set_attn_implementation(implementation)
        trainer.step()
        trainer.step()
        return [p.detach().clone() for m in (trainer.policy, trainer.critic) for p in m.parameters()]

    ours, eager = trained(None), trained("eager")
    assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True))
