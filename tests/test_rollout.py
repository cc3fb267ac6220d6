"""Sampling and EOS handling (ppo_core.lm.rollout).

A response is everything up to and including the first stop token; after it come pads that
no mask, reward or loss may see. These tests drive the real `generate` on a tiny Llama whose
EOS logit is boosted by a hook, so stops are frequent and the masks are actually exercised.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ppo_core.config import SamplingConfig
from ppo_core.lm.rollout import Rollout, generate, left_pad, truncate_after_stop
from tests.conftest import make_prompts
from tests.tiny import tiny_llama

PAD, EOS = 0, 1


def test_truncate_masks_after_first_stop_and_keeps_the_stop_itself() -> None:
    raw = torch.tensor([[4, 5, 1, 6, 1], [4, 7, 5, 1, 6], [4, 5, 6, 8, 9], [9, 9, 9, 9, 7]])
    ids, mask, ended = truncate_after_stop(raw, [1, 7], PAD)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert ids.tolist() == [[4, 5, 1, 0, 0], [4, 7, 0, 0, 0], [4, 5, 6, 8, 9], [9, 9, 9, 9, 7]]
    assert ended.tolist() == [True, True, False, True]


def test_truncate_without_stop_keeps_everything() -> None:
    raw = torch.tensor([[4, 5, 6], [7, 8, 9]])
    ids, mask, ended = truncate_after_stop(raw, [1], PAD)
    assert torch.equal(ids, raw)
    assert torch.all(mask == 1) and not ended.any()


@pytest.fixture
def eos_happy_model() -> Iterator[torch.nn.Module]:
    """A tiny Llama whose EOS logit gets +3 (p(EOS) ~ 0.3 per step), via a forward hook that
    generation and plain forwards both see."""
    model = tiny_llama(seed=1)

    def boost(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[..., EOS] += 3.0
        return output

    handle = model.lm_head.register_forward_hook(boost)
    yield model
    handle.remove()


def _prompts(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad(make_prompts(n, seed=3), PAD)


def _check_masks(rollout: Rollout) -> None:
    ids, mask = rollout.response_ids, rollout.response_mask
    # the mask is a prefix: non-increasing along the response
    assert torch.all(mask[:, 1:] <= mask[:, :-1])
    lengths = mask.sum(1)
    for row in range(ids.shape[0]):
        valid = ids[row, : int(lengths[row])].tolist()
        tail = ids[row, int(lengths[row]) :]
        if rollout.ended[row]:
            assert valid[-1] == EOS and EOS not in valid[:-1]
        else:
            assert EOS not in valid and int(lengths[row]) == ids.shape[1]
        assert torch.all(tail == PAD)


def test_generate_pads_and_masks_everything_after_the_first_eos(eos_happy_model) -> None:
    query_ids, query_mask = _prompts(24)
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0)
    torch.manual_seed(0)
    rollout = generate(eos_happy_model, query_ids, query_mask, sampling, [EOS], PAD)
    _check_masks(rollout)
    lengths = rollout.response_mask.sum(1)
    # the batch exercises both kinds of rows and ragged lengths
    assert rollout.ended.any() and lengths.unique().numel() > 2
    # early EOS happens without min_new_tokens (so the next test is not vacuous)
    assert (lengths <= 2).any()


def test_min_new_tokens_suppresses_eos_at_the_start(eos_happy_model) -> None:
    query_ids, query_mask = _prompts(24)
    sampling = SamplingConfig(max_new_tokens=10, min_new_tokens=4)
    torch.manual_seed(0)
    rollout = generate(eos_happy_model, query_ids, query_mask, sampling, [EOS], PAD)
    _check_masks(rollout)
    assert torch.all(rollout.response_ids[:, :4] != EOS)
    assert torch.all(rollout.response_mask.sum(1) >= 5)
    assert rollout.ended.any()


def test_extra_stop_ids_end_responses_too(eos_happy_model) -> None:
    query_ids, query_mask = _prompts(16)
    stops = [EOS, 5, 6, 7, 8]
    torch.manual_seed(0)
    rollout = generate(
        eos_happy_model, query_ids, query_mask, SamplingConfig(max_new_tokens=10), stops, PAD
    )
    lengths = rollout.response_mask.sum(1)
    for row in range(16):
        valid = rollout.response_ids[row, : int(lengths[row])].tolist()
        hits = [i for i, tok in enumerate(valid) if tok in stops]
        assert hits == ([len(valid) - 1] if rollout.ended[row] else [])
    assert {int(t) for t in rollout.response_ids[rollout.ended, :].flatten()} & {5, 6, 7, 8}


def test_top_k_one_is_the_argmax_continuation() -> None:
    model = tiny_llama(seed=2)
    prompts = make_prompts(4, seed=5)
    query_ids, query_mask = left_pad(prompts, PAD)
    torch.manual_seed(0)
    rollout = generate(
        model, query_ids, query_mask, SamplingConfig(max_new_tokens=6, top_k=1), [EOS], PAD
    )
    for row, prompt in enumerate(prompts):
        seq = torch.tensor([prompt])
        greedy = []
        with torch.no_grad():
            for _ in range(int(rollout.response_mask[row].sum())):
                token = int(model(seq).logits[0, -1].argmax())
                greedy.append(token)
                seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
                if token == EOS:
                    break
        length = int(rollout.response_mask[row].sum())
        assert rollout.response_ids[row, :length].tolist() == greedy
    assert rollout.response_mask.sum() > 0


def test_model_generation_defaults_do_not_change_the_sampling_distribution() -> None:
    """PPO's log-probs are softmax(logits / T); a model's own generation_config (suppressed
    tokens, repetition penalty, n-gram blocking) must not reshape what is actually sampled."""
    model = tiny_llama(seed=0)
    suppressed = list(range(4, 40))
    model.generation_config.suppress_tokens = suppressed
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 1
    query_ids, query_mask = _prompts(8)
    torch.manual_seed(0)
    rollout = generate(model, query_ids, query_mask, SamplingConfig(max_new_tokens=10), [EOS], PAD)
    valid = rollout.response_ids[rollout.response_mask.bool()]
    # 36 of 44 tokens were suppressed by the model's defaults; PPO's sampler must still draw them
    assert sum(int(t) in suppressed for t in valid) > valid.numel() // 2
    # and the model's settings are left as they were
    assert model.generation_config.suppress_tokens == suppressed
    assert model.generation_config.repetition_penalty == 5.0


def test_generate_needs_a_stop_token() -> None:
    query_ids, query_mask = _prompts(2)
    with pytest.raises(ValueError, match="stop"):
        generate(tiny_llama(), query_ids, query_mask, SamplingConfig(max_new_tokens=2), [], PAD)


def test_trimmed_drops_all_pad_columns_only() -> None:
    rollout = Rollout(
        query_ids=torch.tensor([[0, 0, 5, 6], [0, 0, 0, 7]]),
        query_mask=torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]]),
        response_ids=torch.tensor([[8, 1, 0, 0], [9, 9, 1, 0]]),
        response_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]),
        ended=torch.tensor([True, True]),
        logprobs=torch.randn(2, 4),
    )
    trimmed = rollout.trimmed()
    assert trimmed.query_ids.tolist() == [[5, 6], [0, 7]]
    assert trimmed.response_ids.tolist() == [[8, 1, 0], [9, 9, 1]]
    assert trimmed.logprobs is not None and trimmed.logprobs.shape == (2, 3)
    assert trimmed.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
