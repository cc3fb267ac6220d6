"""Packed forwards (ppo_core.lm.packing) equal plain forwards over the padded batch: outputs,
gradients and whole PPO iterations, for one and for several packed rows; the layout is the
one documented; and models packing cannot serve exactly take the plain forward."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

import ppo_core.lm.packing as packing
from ppo_core.config import SamplingConfig
from ppo_core.lm.logprobs import response_logprobs
from ppo_core.lm.packing import bin_rows, can_pack, pack, response_states, shared_prefix_len
from ppo_core.lm.tiny import tiny_llama_config
from ppo_core.ppo.value import CriticModel
from tests.conftest import build_trainer, tiny_gpt2
from tests.tiny import tiny_llama

PREFIX = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]  # 10 tokens, like a chat template's header


def _batch(rests: list[list[int]], response: torch.Tensor, ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[left pad | PREFIX + rest | response, right-padded after `ends[b]` tokens]."""
    prompts = [PREFIX + rest for rest in rests]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width + response.shape[1], dtype=torch.long)
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


@pytest.fixture(params=[1000, 12], ids=["one-packed-row", "several-packed-rows"])
def budget(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(packing, "pack_budget", lambda model, longest: max(longest, request.param))
    return request.param


def test_prefix_length_is_what_all_rows_share_and_stops_before_the_kept_columns() -> None:
    ids, mask, n = _ragged_batch()
    # the last row's prompt is exactly PREFIX: its last prompt token is a kept column
    assert shared_prefix_len(ids, mask, n + 1) == len(PREFIX) - 1
    assert shared_prefix_len(ids[:3], mask[:3], n + 1) == len(PREFIX)
    other = ids.clone()
    other[1, mask[1].argmax() + 4] = 43  # row 1 departs at its 5th token
    assert shared_prefix_len(other, mask, n + 1) == 4
    assert shared_prefix_len(ids[:1], mask[:1], n + 1) == 0  # one row: nothing to share


def test_rows_are_spread_over_few_balanced_bins() -> None:
    assert bin_rows([3, 4, 2, 6], prefix=0, budget=100) == [[0, 1, 2, 3]]
    bins = bin_rows([3, 4, 2, 6], prefix=2, budget=9)  # 15 tokens, 7 per bin after the prefix
    assert sorted(r for rows in bins for r in rows) == [0, 1, 2, 3] and len(bins) == 3
    assert max(2 + sum([3, 4, 2, 6][r] for r in rows) for rows in bins) <= 9
    assert bin_rows([30, 1], prefix=2, budget=10) == [[0], [1]]  # a long row alone
    assert len(bin_rows([5] * 8, prefix=0, budget=20)) == 2


def test_layout_holds_each_rows_real_tokens_after_one_prefix_per_bin() -> None:
    ids, mask, n = _ragged_batch()
    plan = pack(ids, mask, n + 1, budget=20)
    p = len(PREFIX) - 1
    flat_ids, flat_pos = plan.input_ids.reshape(-1), plan.position_ids.reshape(-1)
    for k in range(plan.input_ids.shape[0]):
        assert plan.input_ids[k, :p].tolist() == PREFIX[:p]
        assert plan.position_ids[k, :p].tolist() == list(range(p))
    for b in range(ids.shape[0]):
        real = ids[b][mask[b].bool()].tolist()
        rows = plan.segment == b
        assert plan.input_ids[rows].tolist() == real[p:]  # no pads, prefix not repeated
        assert plan.position_ids[rows].tolist() == list(range(p, len(real)))
        # kept columns map to the same token at the same position, pads to the row's last token
        kept = mask[b, -n - 1 :].bool()
        assert flat_ids[plan.index[b]][kept].tolist() == ids[b, -n - 1 :][kept].tolist()
        assert flat_pos[plan.index[b]][kept].tolist() == (mask[b].cumsum(0) - 1)[-n - 1 :][kept].tolist()
        assert (flat_ids[plan.index[b]][~kept] == real[-1]).all()
    assert plan.input_ids.shape[0] > 1 and plan.input_ids.numel() < ids.numel()
    allowed = plan.attention_mask()
    q, k = plan.segment[0][:, None], plan.segment[0][None, :]
    assert not allowed[0, 0][(q >= 0) & (k >= 0) & (q != k)].any()  # rows never see each other


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "gradient-checkpointing"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2], ids=["llama-rope", "gpt2-absolute"])
def test_logprobs_and_gradients_equal_the_plain_forward(budget: int, temperature: float, factory, checkpointing: bool) -> None:
    """Against the plain forward without checkpointing; with gradient checkpointing the packed
    forward's recomputed layers get the same block mask and positions (checked: they ran)."""
    ids, mask, n = _ragged_batch()
    weights = torch.randn(ids.shape[0], n, generator=torch.Generator().manual_seed(0))
    results = []
    recomputed = []
    for packed in (False, True):
        model = factory(seed=1)
        if packed and checkpointing:
            model.gradient_checkpointing_enable()
            model.train()
            layer = next(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
            next(layer.children()).register_forward_hook(lambda *_: recomputed.append(True))
        assert can_pack(model)
        recomputed.clear()  # can_pack's one-off check of the LM head ran a forward
        logprobs, _ = response_logprobs(model, ids, mask, n, temperature, packed=packed)
        (logprobs * weights * mask[:, -n:]).sum().backward()
        results.append((logprobs.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (plain, plain_grads), (packed_lp, packed_grads) = results
    valid = mask[:, -n:].bool()
    torch.testing.assert_close(packed_lp[valid], plain[valid], atol=1e-5, rtol=1e-5)
    assert max(g.abs().max() for g in plain_grads.values()) > 1e-3
    for key, grad in plain_grads.items():
        torch.testing.assert_close(packed_grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)
    if checkpointing:  # the layer ran in the forward, and again when the backward recomputed it
        assert len(recomputed) == 2, recomputed


def test_critic_values_and_final_hidden_states_equal_the_plain_forward(budget: int) -> None:
    ids, mask, n = _ragged_batch()
    valid = mask[:, -n:].bool()
    critic = CriticModel.from_model(tiny_llama(seed=2))
    torch.nn.init.normal_(critic.head.weight)  # a zero head would hide any difference
    torch.testing.assert_close(critic(ids, mask, n, True)[valid], critic(ids, mask, n, False)[valid], atol=1e-5, rtol=1e-5)
    model = tiny_llama(seed=2)
    (_, plain), (_, packed) = (response_states(model, ids, mask, n + 1, True, flag) for flag in (False, True))
    keep_valid = mask[:, -n - 1 :].bool()
    torch.testing.assert_close(packed[keep_valid], plain[keep_valid], atol=1e-5, rtol=1e-5)


class ScaledHeadLlama(LlamaForCausalLM):
    """A head with post-processing (like Gemma's softcapping) that a packed trunk would skip."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_models_packing_cannot_serve_exactly_take_the_plain_forward() -> None:
    ids, mask, n = _ragged_batch()
    torch.manual_seed(1)
    scaled = ScaledHeadLlama(tiny_llama_config()).eval()
    assert not can_pack(scaled)
    plain, _ = response_logprobs(scaled, ids, mask, n, packed=False)
    torch.testing.assert_close(response_logprobs(scaled, ids, mask, n)[0], plain)

    config = tiny_llama_config()
    config.sliding_window = 4
    assert not can_pack(LlamaForCausalLM(config))


def response_length(rollout) -> torch.Tensor:
    """A score that differs between the rows of a ragged batch (stop ids end rows early). With
    equal scores the whitened advantages would be rounding noise scaled to unit size, and two
    runs would agree only by chance."""
    scores = rollout.response_mask.sum(1).float()
    assert scores.std() > 0.5, scores
    return scores


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_ppo_iterations_packed_and_plain_agree(critic: str) -> None:
    prompts = [PREFIX + rest for rest in ([7], [8, 9], [10, 11, 12], [13], [], [14, 15], [16], [17, 18])]
    sampling_stops = {"stop_token_ids": list(range(4, 10))}  # ragged responses: right pads too
    metrics, policies = [], []
    for packed in (True, False):
        trainer = build_trainer(
            prompts=prompts,
            score_fn=response_length,
            sampling=SamplingConfig(max_new_tokens=6, **sampling_stops),
            critic=critic,
            pack_sequences=packed,
        )
        start = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
        metrics.append([trainer.step() for _ in range(2)])
        policies.append(dict(trainer.policy.named_parameters()))
    for a, b in zip(*metrics, strict=True):
        for key in ("objective/kl", "loss/value", "policy/approxkl", "objective/scores"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        # whitened advantages have mean 0, so the policy loss is a cancellation near 0 whose
        # fp32 rounding is ~1e-6 absolute (measured 2e-6 apart on one draw)
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-4, abs=1e-5)
    # 8 Adam steps at lr 3e-3 moved the weights by ~1e-2; Adam's normalisation lifts rounding
    # differences in near-zero gradients to ~1e-5, far below that
    assert max((policies[1][k] - v).abs().max() for k, v in start.items()) > 5e-3
    for key, value in policies[1].items():
        torch.testing.assert_close(policies[0][key], value, atol=5e-5, rtol=1e-4, msg=key)
