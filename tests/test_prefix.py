"""Shared-prefix forwards (ppo_core.prefix) equal plain forwards: outputs, gradients, and whole
PPO iterations; and they only engage where every row really starts with the same tokens."""

from __future__ import annotations

import pytest
import torch

from ppo_core.logprobs import response_logprobs
from ppo_core.prefix import (
    MIN_SHARED_PREFIX,
    forward_sharing_prefix,
    shared_prefix_len,
    supports_prefix_sharing,
)
from ppo_core.value import CriticModel
from tests.conftest import build_trainer, count_token_score
from tests.tiny import tiny_llama

PREFIX = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]  # 10 tokens, like a chat template's header


def _batch(rests: list[list[int]], response: torch.Tensor, ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[left pad | PREFIX + rest | response (right-padded after `ends[b]` tokens)]."""
    prompts = [PREFIX + rest for rest in rests]
    width = max(map(len, prompts))
    n = response.shape[1]
    ids = torch.zeros(len(prompts), width + n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) : width] = torch.tensor(prompt)
        mask[b, width - len(prompt) : width] = 1
        ids[b, width : width + ends[b]] = response[b, : ends[b]]
        mask[b, width : width + ends[b]] = 1
    return ids, mask


def _ragged_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(3)
    response = torch.randint(4, 44, (4, 6), generator=gen)
    ids, mask = _batch([[7, 8, 9], [11], [12, 13, 14, 15, 16], []], response, [6, 2, 4, 6])
    return ids, mask, 6


def test_prefix_length_is_what_all_rows_share_and_stops_before_the_kept_columns() -> None:
    ids, mask, n = _ragged_batch()
    # the last row's prompt is exactly PREFIX: its last prompt token is a kept column
    assert shared_prefix_len(ids, mask, n + 1) == len(PREFIX) - 1
    assert shared_prefix_len(ids[:3], mask[:3], n + 1) == len(PREFIX)
    other = ids.clone()
    other[1, mask[1].argmax() + 4] = 43  # row 1 departs at its 5th token
    assert shared_prefix_len(other, mask, n + 1) == 4
    assert shared_prefix_len(ids[:1], mask[:1], n + 1) == 0  # one row: nothing to share


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_their_gradients_equal_the_plain_forward(temperature: float) -> None:
    ids, mask, n = _ragged_batch()
    assert shared_prefix_len(ids, mask, n + 1) >= MIN_SHARED_PREFIX
    weights = torch.randn(ids.shape[0], n, generator=torch.Generator().manual_seed(0))
    results = []
    for share in (False, True):
        model = tiny_llama(seed=1)
        logprobs, _ = response_logprobs(model, ids, mask, n, temperature, share_prefix=share)
        (logprobs * weights * mask[:, -n:]).sum().backward()
        results.append((logprobs.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert plain_grads["model.embed_tokens.weight"].abs().max() > 1e-3
    for key, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)


def test_critic_values_and_hidden_states_equal_the_plain_forward() -> None:
    ids, mask, n = _ragged_batch()
    critic = CriticModel.from_model(tiny_llama(seed=2))
    torch.nn.init.normal_(critic.head.weight)  # a zero head would hide any difference
    torch.testing.assert_close(critic(ids, mask, n, True), critic(ids, mask, n, False), atol=1e-5, rtol=1e-5)
    model = tiny_llama(seed=2)
    outs = [
        forward_sharing_prefix(model, ids, mask, n + 1, share, logits_to_keep=n + 1, output_hidden_states=True)
        for share in (False, True)
    ]
    torch.testing.assert_close(outs[1].hidden_states[-1][:, -n - 1 :], outs[0].hidden_states[-1][:, -n - 1 :], atol=1e-5, rtol=1e-5)
    assert outs[1].hidden_states[-1].shape[1] == ids.shape[1] - (len(PREFIX) - 1)  # the suffix only


def test_a_wrong_prefix_length_would_change_the_result() -> None:
    """The equality tests mean something: feeding rows a cache of the wrong prefix differs."""
    ids, mask, n = _ragged_batch()
    model = tiny_llama(seed=1)
    plain, _ = response_logprobs(model, ids, mask, n, share_prefix=False)
    shifted = ids.clone()
    shifted[0, mask[0].argmax()] = 43  # row 0 no longer shares the first token: no sharing at all
    assert shared_prefix_len(shifted, mask, n + 1) == 0
    changed, _ = response_logprobs(model, shifted, mask, n)
    assert (changed[0] - plain[0]).abs().max() > 1e-4
    torch.testing.assert_close(changed[1:], plain[1:], atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_takes_the_plain_forward() -> None:
    """transformers' checkpointed layers drop the cache argument in training, which would
    silently feed rows without their prefix: such models must not share."""
    ids, mask, n = _ragged_batch()
    model = tiny_llama(seed=1)
    assert supports_prefix_sharing(model)
    model.gradient_checkpointing_enable()
    model.train()
    assert not supports_prefix_sharing(model)
    out = forward_sharing_prefix(model, ids, mask, n + 1, logits_to_keep=n + 1, output_hidden_states=True)
    assert out.hidden_states[-1].shape[1] == ids.shape[1]  # every column: the plain forward
    plain, _ = response_logprobs(model, ids, mask, n, share_prefix=False)
    shared, _ = response_logprobs(model, ids, mask, n)
    torch.testing.assert_close(shared, plain)


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_ppo_iterations_with_and_without_prefix_sharing_agree(critic: str) -> None:
    prompts = [PREFIX + rest for rest in ([7], [8, 9], [10, 11, 12], [13], [], [14, 15], [16], [17, 18])]
    metrics, policies = [], []
    for share in (True, False):
        trainer = build_trainer(
            prompts=prompts, score_fn=count_token_score(), critic=critic, share_prompt_prefix=share
        )
        metrics.append([trainer.step() for _ in range(2)])
        policies.append(dict(trainer.policy.named_parameters()))
    for a, b in zip(*metrics, strict=True):
        for key in ("objective/kl", "loss/policy", "loss/value", "policy/approxkl", "objective/scores"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    for key, value in policies[1].items():
        torch.testing.assert_close(policies[0][key], value, atol=1e-5, rtol=1e-4, msg=key)
