"""The critic (ppo_core.ppo.value): V(s_t) is read at the state *before* response token t, is the
same whatever padding shares its batch, and survives a save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_core.ppo.value import CriticModel, SharedValueHead
from tests.conftest import padded_pair, tiny_gpt2
from tests.tiny import tiny_llama


def _randomise_head(critic: CriticModel | SharedValueHead, seed: int = 0) -> None:
    """A zero head makes every value 0 and every comparison vacuous; give it real weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.head.weight.copy_(torch.randn(critic.head.weight.shape, generator=gen))
        critic.head.bias.fill_(0.3)


def _values(critic: CriticModel, rollout) -> torch.Tensor:
    with torch.no_grad():
        return critic(rollout.input_ids, rollout.attention_mask, rollout.response_len)


def test_fresh_critic_has_zero_values_and_copies_the_policy_trunk() -> None:
    policy = tiny_llama(seed=5)
    critic = CriticModel.from_model(policy)
    trunk = policy.model.state_dict()
    for key, tensor in critic.backbone.state_dict().items():
        torch.testing.assert_close(tensor, trunk[key], atol=0, rtol=0)
    _, batch = padded_pair()
    assert torch.all(_values(critic, batch) == 0)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_critic_values_are_padding_invariant(factory) -> None:
    critic = CriticModel.from_model(factory(seed=0))
    _randomise_head(critic)
    alone, batch = padded_pair()
    v_alone, v_batch = _values(critic, alone), _values(critic, batch)
    assert v_alone.abs().min() > 1e-3
    torch.testing.assert_close(v_batch[0, :2], v_alone[0], atol=1e-5, rtol=0)


def test_value_of_step_t_does_not_see_token_t() -> None:
    """V_t estimates the return from s_t, the state before a_t is chosen: changing a_t may only
    move V_{t+1}, V_{t+2}, ..."""
    critic = CriticModel.from_model(tiny_llama(seed=1))
    _, batch = padded_pair()
    _randomise_head(critic)
    before = _values(critic, batch)
    changed_ids = batch.response_ids.clone()
    changed_ids[1, 2] = 40 if int(changed_ids[1, 2]) != 40 else 41
    batch.response_ids = changed_ids
    after = _values(critic, batch)
    torch.testing.assert_close(after[1, :3], before[1, :3], atol=1e-6, rtol=0)
    assert (after[1, 3:] - before[1, 3:]).abs().min() > 1e-5
    torch.testing.assert_close(after[0], before[0], atol=1e-6, rtol=0)


def test_shared_head_reads_the_state_before_each_response_token() -> None:
    hidden = torch.randn(2, 7, 4)
    head = SharedValueHead(4)
    _randomise_head(head)
    with torch.no_grad():
        values = head(hidden, response_len=3)
        expected = head.head(hidden[:, 3:6]).squeeze(-1)
    torch.testing.assert_close(values, expected)


def test_critic_save_and_load_round_trip(tmp_path: Path) -> None:
    critic = CriticModel.from_model(tiny_llama(seed=2))
    _randomise_head(critic, seed=3)
    _, batch = padded_pair()
    critic.save_pretrained(tmp_path)
    restored = CriticModel.from_pretrained(tmp_path)
    torch.testing.assert_close(_values(restored, batch), _values(critic, batch), atol=1e-6, rtol=0)
