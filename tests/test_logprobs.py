"""Log-probabilities of sampled tokens (ppo_core.lm.logprobs) and their padding invariance.

pi_theta(a_t|s_t) must be the distribution the token was drawn from (same temperature, same
positions), whatever else shares the batch: otherwise the PPO ratio is not 1 at the first step
and the KL to the reference measures padding instead of policy change.
"""

from __future__ import annotations

import pytest
import torch

from ppo_core.config import SamplingConfig
from ppo_core.lm.logprobs import (
    log_softmax_and_entropy,
    position_ids_from_mask,
    response_logprobs,
    selective_log_softmax,
)
from ppo_core.lm.rollout import Rollout, generate, left_pad
from ppo_core.ppo.kl import kl_estimate
from ppo_core.ppo.rewards import token_rewards
from tests.conftest import make_prompts, padded_pair, tiny_gpt2
from tests.tiny import tiny_llama

PAD, EOS = 0, 1


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 15, 4096])
def test_selective_log_softmax_equals_log_softmax_gather(chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    index = torch.randint(0, 11, (3, 5), generator=gen)
    expected = torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)
    got = selective_log_softmax(logits, index, chunk_size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert got.shape == index.shape and got.dtype == torch.float32


@pytest.mark.parametrize("chunk_size", [1, 4, 4096])
def test_fused_log_softmax_and_entropy_equal_their_definitions(chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    logits = (torch.randn(3, 5, 11, generator=gen) * 4).bfloat16()  # bf16 logits, as the trainer's
    index = torch.randint(0, 11, (3, 5), generator=gen)
    logprobs, entropy = log_softmax_and_entropy(logits, index, chunk_size)
    logp = torch.log_softmax(logits.double(), -1)
    assert logprobs.dtype == entropy.dtype == torch.float32 and entropy.shape == index.shape
    assert torch.equal(logprobs, selective_log_softmax(logits, index, chunk_size))
    torch.testing.assert_close(entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_fused_entropy_has_a_gradient_only_when_asked(entropy_grad: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 9, generator=gen) * 3).requires_grad_()
    index = torch.randint(0, 9, (4,), generator=gen)
    logprobs, entropy = log_softmax_and_entropy(logits, index, chunk_size=3, entropy_grad=entropy_grad)
    assert logprobs.requires_grad and entropy.requires_grad == entropy_grad
    if entropy_grad:  # d(sum H)/dl equals autograd through the textbook -sum p log p
        (grad,) = torch.autograd.grad(entropy.sum(), logits)
        logp = torch.log_softmax(logits, -1)
        (expected,) = torch.autograd.grad(-(logp.exp() * logp).sum(), logits)
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=0)


def _autograd_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The formula before the custom backward: an fp32 copy, logsumexp and gather under autograd."""
    rows = logits.reshape(-1, logits.shape[-1]).float()
    return (rows.gather(-1, index.reshape(-1, 1)).squeeze(-1) - torch.logsumexp(rows, -1)).view(index.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("entropy", [False, True], ids=["selective", "with-entropy"])
def test_log_probs_and_their_gradient_equal_autograds_bit_for_bit(dtype: torch.dtype, entropy: bool) -> None:
    """The custom backward reproduces autograd through logsumexp and gather exactly; in bf16 it
    keeps the bf16 logits for the backward (2 bytes per logit), not an fp32 copy (4)."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 64, generator=gen) * 4).to(dtype).requires_grad_()
    index = torch.randint(0, 64, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if entropy:
            got, _ = log_softmax_and_entropy(logits, index, chunk_size=4, entropy_grad=False)
        else:
            got = selective_log_softmax(logits, index, chunk_size=4)
    expected = _autograd_log_softmax(logits, index)
    assert torch.equal(got, expected)
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    assert torch.equal(grad, expected_grad)
    assert {t.dtype for t in saved if t.dim() == 2} == {dtype}  # the logit rows, as they came


def test_position_ids_count_real_tokens_only() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_response_logprobs_use_the_temperature() -> None:
    model = tiny_llama(seed=0)
    ids = torch.tensor([[7, 20, 33, 12, 5, 1]])
    am = torch.ones_like(ids)
    n, temp = 3, 0.6
    with torch.no_grad():
        full = model(ids).logits[0, -n - 1 : -1] / temp
        got, logits = response_logprobs(model, ids, am, n, temperature=temp)
        at_one, _ = response_logprobs(model, ids, am, n, temperature=1.0)
    expected = torch.log_softmax(full, -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
    torch.testing.assert_close(got[0], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits[0], full, atol=1e-6, rtol=0)
    assert (got - at_one).abs().max() > 1e-2  # the temperature is not silently ignored


def test_generation_logprobs_match_a_full_forward() -> None:
    model = tiny_llama(seed=4)
    query_ids, query_mask = left_pad(make_prompts(8, seed=2), PAD)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7)
    torch.manual_seed(0)
    rollout = generate(model, query_ids, query_mask, sampling, [EOS], PAD, want_logprobs=True)
    assert rollout.logprobs is not None
    with torch.no_grad():
        forward, _ = response_logprobs(
            model,
            rollout.input_ids,
            rollout.attention_mask,
            rollout.response_len,
            sampling.temperature,
        )
    mask = rollout.response_mask.bool()
    assert mask.sum() > 8
    torch.testing.assert_close(rollout.logprobs[mask], forward[mask], atol=1e-5, rtol=0)
    assert torch.all(rollout.logprobs[~mask] == 0)


def _row0(values: torch.Tensor, length: int = 2) -> torch.Tensor:
    return values[0, :length]


def _logprobs(model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(
            model, rollout.input_ids, rollout.attention_mask, rollout.response_len
        )[0]


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2], ids=["llama-rope", "gpt2-abs-pos"])
def test_logprobs_are_padding_invariant(factory) -> None:
    model = factory(seed=0)
    alone, batch = padded_pair()
    expected = _row0(_logprobs(model, alone))
    torch.testing.assert_close(_row0(_logprobs(model, batch)), expected, atol=1e-5, rtol=0)
    if factory is tiny_gpt2:
        # with absolute positions the invariance is earned by position_ids_from_mask: a naive
        # forward (positions counting the left pads) differs, so this test would catch its loss
        with torch.no_grad():
            naive = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        naive_lp = torch.log_softmax(naive[0, -6:-4], -1).gather(
            -1, batch.response_ids[0, :2, None]
        )
        assert (naive_lp.squeeze(-1) - expected).abs().max() > 1e-3


def test_token_rewards_are_padding_invariant() -> None:
    policy, ref = tiny_llama(seed=0), tiny_llama(seed=3)
    alone, batch = padded_pair()

    def rewards(rollout: Rollout, scores: torch.Tensor) -> torch.Tensor:
        kl = (
            kl_estimate(_logprobs(policy, rollout), _logprobs(ref, rollout), "k1")
            * rollout.response_mask
        )
        return token_rewards(scores, kl, rollout.response_mask, beta=0.3)

    r_alone = rewards(alone, torch.tensor([1.5]))
    r_batch = rewards(batch, torch.tensor([1.5, -4.0]))
    torch.testing.assert_close(_row0(r_batch), _row0(r_alone), atol=1e-5, rtol=0)
    assert torch.all(r_batch[0, 2:] == 0)
    assert r_alone[0, 1].item() != pytest.approx(r_alone[0, 0].item() + 1.5, abs=1e-3)
