"""Evaluation on tiny models: KL to the reference, win rate, the evaluate entry points, the report
markdown. (The report logic on constructed evaluations is in test_eval_report.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from ppo_core.config import SamplingConfig
from ppo_core.eval.evaluate import (
    HeldOut,
    ReferenceSample,
    evaluate_policy,
    evaluate_reference,
    sequence_kl,
    win_rate,
)
from ppo_core.eval.markdown import report_markdown, rounds_table
from ppo_core.eval.report import (
    build_report,
)
from ppo_core.eval.stats import mean_and_se, prompt_mean_and_se
from ppo_core.lm.rollout import Rollout, generate, left_pad
from tests.test_eval_report import ev
from tests.tiny import tiny_llama, tiny_tokenizer

torch.set_num_threads(1)
EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return tiny_llama(seed=0)


def perturbed(model: torch.nn.Module, scale: float = 0.1, seed: int = 1) -> torch.nn.Module:
    copy_ = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy_.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return copy_


def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    temperature: float = 1.0,
    n: int = 6,
    seed: int = 0,
) -> Rollout:
    torch.manual_seed(seed)
    q, m = left_pad(prompts, PAD)
    cfg = SamplingConfig(max_new_tokens=n, temperature=temperature)
    return generate(model, q, m, cfg, [EOS], PAD, want_logprobs=False).trimmed()


def hand_rollout(
    prompts: list[list[int]], responses: list[list[int]], width: int | None = None
) -> Rollout:
    """A rollout built by hand; response tokens after the mask are arbitrary (not pad)."""
    q, qm = left_pad(prompts, PAD)
    width = width or max(len(r) for r in responses)
    ids = torch.full((len(responses), width), 17)  # junk after the end, masked out
    mask = torch.zeros((len(responses), width), dtype=torch.long)
    for row, r in enumerate(responses):
        ids[row, : len(r)] = torch.tensor(r)
        mask[row, : len(r)] = 1
    ended = torch.tensor([r[-1] == EOS for r in responses])
    return Rollout(q, qm, ids, mask, ended)


# ---- exact and sampled KL -------------------------------------------------------------------
def test_exact_kl_is_zero_for_the_reference_itself_and_positive_after_a_perturbation(ref) -> None:
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    same = copy.deepcopy(ref)
    rollout = sample(same, prompts)
    kl = sequence_kl(same, ref, rollout)
    for value in kl:
        torch.testing.assert_close(value, torch.zeros(3), atol=1e-6, rtol=0)
    moved = perturbed(ref)
    kl_moved = sequence_kl(moved, ref, sample(moved, prompts)).exact
    assert (kl_moved > 1e-3).all(), kl_moved


def brute_force_kl(
    policy, ref, prompt: list[int], response: list[int], temperature: float
) -> float:
    """Unpadded single sequence, full log_softmax over every position, no chunking."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(policy(ids).logits[0] / temperature, -1)
        logq = torch.log_softmax(ref(ids).logits[0] / temperature, -1)
    # the logits at positions P-1 .. P+R-2 predict the R response tokens
    positions = range(len(prompt) - 1, len(prompt) + len(response) - 1)
    return sum(float((logp[t].exp() * (logp[t] - logq[t])).sum()) for t in positions)


def test_exact_kl_matches_a_brute_force_full_softmax(ref) -> None:
    policy = perturbed(ref, 0.2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    responses = [[20, 21, 22, EOS], [23, 24], [25, EOS]]
    rollout = hand_rollout(prompts, responses)
    # chunk_size 5 does not divide the 3 x 4 = 12 token rows: the chunk boundaries are exercised
    got = sequence_kl(policy, ref, rollout, temperature=0.7, chunk_size=5).exact
    want = torch.tensor(
        [brute_force_kl(policy, ref, p, r, 0.7) for p, r in zip(prompts, responses, strict=True)]
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the sampled estimators use the same log-probs: k1 = sum log pi(a_t) - log pi_ref(a_t)
    kl = sequence_kl(policy, ref, rollout, temperature=0.7)
    k1, k3 = kl.k1, kl.k3
    assert (k3 >= 0).all() and not torch.allclose(k1, got)


def test_exact_kl_ignores_tokens_after_eos_and_is_padding_invariant(ref) -> None:
    policy = perturbed(ref, 0.2)
    short_prompt, short_response = [5, 6], [20, 21, EOS]
    alone = sequence_kl(policy, ref, hand_rollout([short_prompt], [short_response])).exact
    # beside a longer prompt (left padding) and a longer response (right padding + junk tokens)
    both = hand_rollout(
        [short_prompt, [7, 8, 9, 10, 11, 12]], [short_response, [22, 23, 24, 25, 26, 27, EOS]]
    )
    beside = sequence_kl(policy, ref, both).exact
    torch.testing.assert_close(beside[0], alone[0], atol=1e-5, rtol=1e-5)
    # changing what sits after EOS (masked) changes nothing
    other_junk = hand_rollout([short_prompt], [short_response], width=6)
    other_junk.response_ids[0, 3:] = torch.tensor([30, 31, 32])
    junk_kl = sequence_kl(policy, ref, other_junk).exact
    torch.testing.assert_close(junk_kl, alone, atol=1e-5, rtol=1e-5)
    assert float(beside[1]) > float(alone[0])  # the longer row does count its own tokens


def test_sampled_k1_and_k3_average_to_the_exact_kl(ref) -> None:
    policy = perturbed(ref, 0.1)
    prompts = [[5 + i % 7, 9, 12 + i % 3] for i in range(2048)]
    rollout = sample(policy, prompts, temperature=0.8)
    kl = sequence_kl(policy, ref, rollout, temperature=0.8, chunk_size=4096)
    exact = kl.exact.mean().item()
    assert exact > 0.5  # a perturbation large enough for the comparison to mean something
    # standard errors at 2048 samples: ~0.04 (k1), ~0.02 (k3); tolerance ~ 4 sigma of k1
    assert abs(kl.k1.mean().item() - exact) < 0.15, (kl.k1.mean(), exact)
    assert abs(kl.k3.mean().item() - exact) < 0.1, (kl.k3.mean(), exact)


# ---- win rate and the evaluate entry points -------------------------------------------------
def test_win_rate_counts_ties_as_half() -> None:
    assert win_rate([1.0, 2.0, 3.0, 0.0], [1.0, 1.0, 4.0, 0.0]) == pytest.approx(
        (0.5 + 1 + 0 + 0.5) / 4
    )
    with pytest.raises(ValueError):
        win_rate([1.0], [1.0, 2.0])


def word_sum(prompts: list[str], responses: list[str]) -> torch.Tensor:
    """A scorer with many distinct values (few ties): the sum of the word numbers."""
    return torch.tensor([float(sum(int(w[1:]) for w in r.split())) for r in responses])


def count_w39(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(r.split().count("w39")) for r in responses]


def held_out(n: int) -> tuple[list[str], list[list[int]]]:
    tok = tiny_tokenizer()
    texts = [f"w{i % 40} w{(i * 7) % 40} w{(i * 13) % 40}" for i in range(n)]
    return texts, [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_win_rate_against_itself_is_one_half_and_a_better_policy_wins(ref) -> None:
    tok, sampling = tiny_tokenizer(), SamplingConfig(max_new_tokens=6)
    texts, ids = held_out(300)
    held = HeldOut(tok, texts, ids, sampling, word_sum, count_w39)
    baseline, reference = evaluate_reference(ref, held, seed=1)
    assert (baseline.kl_exact, baseline.win_rate_proxy, baseline.win_rate_gold) == (0.0, 0.5, 0.5)
    # the same weights, an independent sample (seed 0 vs the reference's seed 1)
    same = evaluate_policy(copy.deepcopy(ref), ref, held, reference, seed=0)
    assert abs(same.kl_exact) < 1e-6
    assert abs(same.win_rate_proxy - 0.5) < 0.08, same.win_rate_proxy  # sd ~ 0.028 at n = 300
    assert abs(same.proxy_reward - baseline.proxy_reward) > 0  # really a different sample
    # the same seed reproduces the reference's responses exactly: all ties, exactly 0.5
    no_gold = HeldOut(tok, texts, ids, sampling, word_sum)
    tied = evaluate_policy(copy.deepcopy(ref), ref, no_gold, reference, seed=1)
    assert tied.win_rate_proxy == 0.5 and tied.proxy_reward == baseline.proxy_reward
    # a policy that prefers w39 (id 43) wins on the w39-counting gold scorer and pays KL for it
    better = copy.deepcopy(ref)
    bias = torch.zeros(better.config.vocab_size)
    bias[43] = 3.0
    better.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    won = evaluate_policy(better, ref, held, reference)
    assert won.win_rate_gold > 0.75 and won.gold_reward > baseline.gold_reward + 0.5
    assert won.kl_exact > 1.0 and won.kl_k3 > 1.0


def test_evaluate_policy_is_seeded_and_leaves_the_callers_rng_alone(ref) -> None:
    tok, sampling = tiny_tokenizer(), SamplingConfig(max_new_tokens=5)
    texts, ids = held_out(12)
    policy = perturbed(ref)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    held = HeldOut(tok, texts, ids, sampling, word_sum, batch_size=5, n_samples=3)
    first = evaluate_policy(policy, ref, held)
    assert torch.equal(torch.rand(3), expected_next)
    second = evaluate_policy(policy, ref, held)
    assert first == second
    assert first.n == 12 and len(first.samples) == 3 and first.samples[0].prompt == texts[0]
    assert (
        first.gold_reward is None and first.win_rate_gold is None and first.win_rate_proxy is None
    )
    assert 0 < first.response_length <= 5 and 0 <= first.eos_rate <= 1
    # one batch at T = 0.7 is exactly: seed, generate, KL at the sampling temperature
    warm = SamplingConfig(max_new_tokens=5, temperature=0.7)
    one_batch = evaluate_policy(policy, ref, HeldOut(tok, texts, ids, warm, word_sum, batch_size=12), seed=4)
    rollout = sample(policy, ids, temperature=0.7, n=5, seed=4)
    kl = sequence_kl(policy, ref, rollout, temperature=0.7)
    assert one_batch.kl_exact == pytest.approx(kl.exact.mean().item(), abs=1e-6)
    assert one_batch.kl_k1 == pytest.approx(kl.k1.mean().item(), abs=1e-6)
    assert one_batch.response_length == pytest.approx(
        rollout.response_mask.sum(1).float().mean().item()
    )
    wrong = ReferenceSample(prompts=texts[::-1], responses=texts, proxy_scores=[0.0] * 12)
    with pytest.raises(ValueError, match="different prompts"):
        evaluate_policy(policy, ref, held, ref_responses=wrong)
    with pytest.raises(ValueError, match="non-finite"):
        evaluate_policy(policy, ref, HeldOut(tok, texts, ids, sampling, lambda p, r: [float("nan")] * len(r)))


def test_prompt_mean_and_se_takes_the_error_over_prompts_not_responses() -> None:
    # two prompts, two samples each, laid out prompt-major per sample: [p0, p1, p0, p1]
    values = [0.0, 10.0, 0.0, 10.0]
    mean, se = prompt_mean_and_se(values, 2)
    assert mean == 5.0
    assert se == pytest.approx(5.0)  # per-prompt means 0 and 10: std 7.07 / sqrt(2)
    assert mean_and_se(values)[1] == pytest.approx(2.887, abs=1e-3)  # what n = 4 would claim
    assert prompt_mean_and_se([1.0, 2.0, 3.0], 3) == mean_and_se([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="do not tile 2 prompts"):
        prompt_mean_and_se([1.0, 2.0, 3.0], 2)


def prompt_gold(prompts: list[str], responses: list[str]) -> list[float]:
    """A gold score that depends on the prompt only: every policy gains exactly 0."""
    return [float(p.split()[0][1:]) for p in prompts]


def test_several_samples_per_prompt_pair_the_gold_gain_by_prompt(ref) -> None:
    tok, sampling = tiny_tokenizer(), SamplingConfig(max_new_tokens=6)
    texts, ids = held_out(10)
    held = HeldOut(tok, texts, ids, sampling, word_sum, prompt_gold, samples_per_prompt=3)
    baseline, reference = evaluate_reference(ref, held)
    assert (baseline.n, baseline.samples_per_prompt) == (10, 3)
    assert reference.prompts == texts * 3 and len(reference.responses) == 30
    assert any(len(set(reference.responses[i::10])) > 1 for i in range(10))  # independent draws
    assert baseline.proxy_reward_se == pytest.approx(
        prompt_mean_and_se(reference.proxy_scores, 10)[1]
    )
    policy = evaluate_policy(perturbed(ref), ref, held, reference)
    # prompt spread makes each gold mean uncertain, but it cancels in the paired gain
    assert policy.gold_reward == pytest.approx(baseline.gold_reward)
    assert policy.gold_reward_se > 0.5 and policy.gold_gain_se == pytest.approx(0.0)
    table = rounds_table(build_report(baseline, {1: policy}, final=policy))
    assert "| 10 x 3 |" in table and "+0.000 ± 0.000" in table
    one = HeldOut(tok, texts, ids, sampling, word_sum)
    with pytest.raises(ValueError, match="different prompts"):  # drawn for 3 samples, not 1
        evaluate_policy(perturbed(ref), ref, one, ref_responses=reference)
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 1"):
        evaluate_policy(perturbed(ref), ref, HeldOut(tok, texts, ids, sampling, word_sum, samples_per_prompt=0))


# ---- report markdown (tiny-model evaluations) ---------------------------------------------
def test_report_markdown_has_a_row_per_round_and_side_by_side_samples(ref) -> None:
    tok, sampling = tiny_tokenizer(), SamplingConfig(max_new_tokens=4)
    texts, ids = held_out(6)
    baseline, reference = evaluate_reference(ref, HeldOut(tok, texts, ids, sampling, word_sum, count_w39))
    final = evaluate_policy(
        perturbed(ref), ref, HeldOut(tok, texts, ids, sampling, word_sum, count_w39, n_samples=2), reference
    )
    text = report_markdown(build_report(baseline, {1: ev(0.5, 0.3, 1.0), 2: final}, final=final))
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in table_rows[:4]] == [
        "round",
        "reference",
        "1 (best)",
        "2",
    ]
    assert final.samples[0].response in text and reference.responses[0] in text
