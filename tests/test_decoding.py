"""Our sampling loop (ppo_core.lm.decoding): the distribution it draws from, and the processors.

`rollout.generate` no longer calls transformers' `generate`; these tests pin what it replaced:
the inverse-CDF draw has the softmax's frequencies, the processors equal transformers' own
(min-new-tokens, temperature, top-k, top-p in that order), and a cached step-by-step decode gives
the same tokens and log-probs as full forwards over the growing sequence.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ppo_core.config import SamplingConfig
from ppo_core.lm.decoding import decode, sample_categorical, warp_scores
from ppo_core.lm.rollout import left_pad
from tests.conftest import make_prompts
from tests.tiny import tiny_llama

PAD, EOS = 0, 1


def test_inverse_cdf_draws_have_the_softmax_frequencies_and_never_a_zero_probability_token() -> None:
    probs = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.0, 0.3])
    scores = probs.log().expand(200_000, -1)
    torch.manual_seed(0)
    counts = torch.bincount(sample_categorical(scores), minlength=6).float() / 200_000
    # binomial SE at p=0.4 and n=2e5 is 0.0011: 0.005 is > 4 SE
    assert torch.allclose(counts, probs, atol=0.005), counts
    assert counts[1] == 0 and counts[4] == 0


def test_a_degenerate_distribution_always_draws_its_one_token() -> None:
    scores = torch.full((1000, 50), float("-inf"))
    scores[:, 49] = 0.0  # the last index: the cumulative sum's end
    scores[:500, 49], scores[:500, 0] = float("-inf"), 0.0  # and the first
    torch.manual_seed(0)
    tokens = sample_categorical(scores)
    assert torch.all(tokens[:500] == 0) and torch.all(tokens[500:] == 49)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.7),
        SamplingConfig(temperature=1.3, top_k=5),
        SamplingConfig(temperature=0.8, top_p=0.6),
        SamplingConfig(temperature=1.0, top_k=10, top_p=0.9, min_new_tokens=3),
    ],
    ids=["temperature", "top_k", "top_p", "all"],
)
def test_processors_equal_transformers_own_chain(sampling: SamplingConfig) -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 40) * 3
    stops = torch.tensor([EOS, 7])
    processors = LogitsProcessorList([
        MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=0, min_new_tokens=sampling.min_new_tokens,
                                          eos_token_id=stops.tolist()),
        TemperatureLogitsWarper(sampling.temperature),
        *([TopKLogitsWarper(sampling.top_k)] if sampling.top_k else []),
        *([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []),
    ])
    for step in (0, 2, 3, 5):
        ours = warp_scores(logits, sampling, step, stops)
        theirs = processors(torch.zeros(16, step, dtype=torch.long), logits.clone())
        assert torch.equal(ours.isinf(), theirs.isinf()), step
        finite = ~ours.isinf()
        assert torch.allclose(ours[finite], theirs[finite]), step
    # the cases filter something (so the comparison is not between two unfiltered copies)
    if sampling.top_k or sampling.top_p < 1:
        assert warp_scores(logits, sampling, 5, stops).isinf().any()


def _with_shared_prefix(prompts: list[list[int]], prefix_len: int) -> list[list[int]]:
    """The prompts behind one common prefix (as a chat template's system block puts it)."""
    prefix = make_prompts(1, seed=11, min_len=prefix_len, max_len=prefix_len)[0]
    return [prefix + p for p in prompts]


def _batch_sizes_of_forwards(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(rows, tokens) of every forward of `model` from now on."""
    shapes: list[tuple[int, int]] = []
    def record(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        shapes.append(tuple(kwargs.get("input_ids", args[0] if args else None).shape))

    model.register_forward_pre_hook(record, with_kwargs=True)
    return shapes


@pytest.mark.parametrize("shared_prefix", [0, 6])
def test_cached_decode_equals_full_forwards_over_the_growing_sequence(shared_prefix: int) -> None:
    """Every token and log-prob of the KV-cached loop (left-padded batch, positions from the mask)
    equals what full forwards over each row alone give, drawing the same uniforms; with a prefix
    every prompt shares, it is prefilled once at batch 1 and its cache copied to every row."""
    model = tiny_llama(seed=3)
    prompts = make_prompts(6, seed=4)
    if shared_prefix:
        prompts = _with_shared_prefix(prompts, shared_prefix)
    query_ids, query_mask = left_pad(prompts, PAD)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.9)
    forwards = _batch_sizes_of_forwards(model)
    torch.manual_seed(0)
    raw, logprobs = decode(model, query_ids, query_mask, sampling, [EOS], PAD)
    assert logprobs is not None
    # the prefill's forwards: the prefix at batch 1, then every row's rest (or all of every row)
    width = query_ids.shape[1]
    assert forwards[:2] == ([(1, shared_prefix), (6, width - shared_prefix)] if shared_prefix else [(6, width), (6, 1)])
    torch.manual_seed(0)
    uniforms = [torch.rand(6, 1) for _ in range(raw.shape[1])]  # the loop's draws, in order
    for row, prompt in enumerate(prompts):
        seq = torch.tensor([prompt])
        for step in range(raw.shape[1]):
            with torch.no_grad():
                logits = model(seq).logits[0, -1] / sampling.temperature
            cdf = logits.softmax(-1).cumsum(-1)
            token = int(torch.searchsorted(cdf, (1 - uniforms[step][row]) * cdf[-1]))
            assert token == int(raw[row, step]), (row, step)
            assert float(logits.log_softmax(-1)[token]) == pytest.approx(float(logprobs[row, step]), abs=1e-5)
            if token == EOS:
                assert torch.all(raw[row, step + 1 :] == PAD)
                break
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
