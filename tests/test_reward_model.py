"""Reward model: Bradley-Terry loss, training a tiny RM, scoring at the right token, scoring
rollouts through another tokenizer, normalisation, and the saved folder."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BertConfig, BertModel, BertTokenizer, PreTrainedTokenizerFast

from ppo_core.config import DeviceConfig
from ppo_core.data.preferences import PreferenceRow
from ppo_core.lm.models import transformer_blocks
from ppo_core.lm.placement import resolve_placement
from ppo_core.lm.rollout import Rollout, left_pad
from ppo_core.reward.config import RewardModelConfig
from ppo_core.reward.model import RewardModel, RewardScorer, scalar_head
from ppo_core.reward.training import (
    bradley_terry_loss,
    centering_loss,
    fit_normalisation,
    linear_schedule,
    pairwise_accuracy,
    train_reward_model,
)
from tests.tiny import WORDS, tiny_llama, tiny_tokenizer

GOOD, BAD, NEUTRAL = WORDS[:5], WORDS[5:10], WORDS[20:]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def llama_rm_dir(
    tmp_path: Path, hidden: int = 32, tokenizer: PreTrainedTokenizerFast | None = None
) -> Path:
    """A tiny causal LM checkpoint (no score head): the RM must create its head."""
    folder = tmp_path / f"llama{hidden}"
    tiny_llama(hidden=hidden).save_pretrained(folder)
    (tokenizer or tiny_tokenizer()).save_pretrained(folder)
    return folder


def bert_rm_dir(tmp_path: Path) -> Path:
    """A tiny BERT backbone with dropout 0.1 and a WordPiece vocabulary whose ids differ from
    the tiny policy tokenizer's."""
    folder = tmp_path / "bert"
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(folder)
    BertTokenizer(vocab=vocab).save_pretrained(folder)
    return folder


def reversed_tokenizer() -> PreTrainedTokenizerFast:
    """Same words as the tiny tokenizer, different ids and special-token names."""
    vocab = {t: i for i, t in enumerate(["[pad]", "[unk]", "[s]", "[/s]", *reversed(WORDS)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[unk]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[pad]",
        eos_token="[/s]",
        bos_token="[s]",
        unk_token="[unk]",
    )


def separable_rows(n: int, seed: int) -> list[PreferenceRow]:
    """Chosen answers contain a 'good' word, rejected ones a 'bad' word, among neutral words."""
    rng = random.Random(seed)

    def answer(sentiment: list[str]) -> str:
        words = rng.sample(NEUTRAL, 4)
        words.insert(rng.randrange(5), rng.choice(sentiment))
        return " ".join(words)

    return [
        PreferenceRow(
            prompt=" ".join(rng.sample(NEUTRAL, 3)), chosen=answer(GOOD), rejected=answer(BAD)
        )
        for _ in range(n)
    ]


def word_gold(prompts: list[str], responses: list[str]) -> list[float]:
    return [sum((w in GOOD) - (w in BAD) for w in r.split()) / 2 for r in responses]


# --- Bradley-Terry ------------------------------------------------------------------------------


def test_bradley_terry_gradient_raises_chosen_lowers_rejected_and_margin_shifts_it() -> None:
    r_c = torch.tensor([0.3, -1.0], requires_grad=True)
    r_r = torch.tensor([0.1, 0.5], requires_grad=True)
    loss = bradley_terry_loss(r_c, r_r)
    loss.backward()
    assert (r_c.grad < 0).all() and (r_r.grad > 0).all()  # descent raises r_c, lowers r_r
    expected = -(math.log(1 / (1 + math.exp(-0.2))) + math.log(1 / (1 + math.exp(1.5)))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)

    margin = torch.tensor([1.0, 1.0])
    shifted = bradley_terry_loss(r_c, r_r, margin)
    assert shifted.item() == pytest.approx(bradley_terry_loss(r_c - 1.0, r_r).item(), rel=1e-6)
    assert shifted.item() > loss.item()  # a required margin makes the same scores worse
    big = bradley_terry_loss(torch.tensor([50.0]), torch.tensor([-50.0]))
    assert torch.isfinite(big) and big.item() < 1e-20


def test_centering_term_and_schedule() -> None:
    assert centering_loss(torch.tensor([2.0]), torch.tensor([-2.0])).item() == 0.0
    assert centering_loss(torch.tensor([3.0]), torch.tensor([1.0])).item() == 16.0
    factor = linear_schedule(total_steps=10, warmup_steps=2)
    assert [factor(s) for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]


# --- training -----------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_tiny_rm_learns_separable_preferences(tmp_path: Path, kind: str, precision: str) -> None:
    """In fp32, and in bf16 with fp32 master weights (ppo_core.lm.precision)."""
    backbone = llama_rm_dir(tmp_path) if kind == "llama" else bert_rm_dir(tmp_path)
    train, held_out = separable_rows(256, seed=0), separable_rows(100, seed=1)
    cfg = RewardModelConfig(
        backbone=str(backbone), learning_rate=3e-3, epochs=3, batch_size=16, device="cpu"
    )
    seen: list[tuple[int, dict]] = []
    where = resolve_placement(DeviceConfig(device="cpu", precision=precision))
    rm, report = train_reward_model(
        cfg, train, held_out, on_metrics=lambda s, m: seen.append((s, m)), gold_scorer=word_gold, placement=where
    )
    assert {p.dtype for p in rm.model.parameters()} == {where.dtype}
    assert report.eval_accuracy >= 0.9, report
    assert report.gold_agreement >= 0.9 and report.n_gold_pairs == 100  # every pair has gap 1
    assert report.seconds < 60
    assert [s for s, _ in seen] == list(range(1, 3 * 16 + 1)) == list(range(1, report.steps + 1))
    assert {"rm/loss", "rm/accuracy", "rm/margin"} <= set(seen[0][1])
    assert seen[-1][1]["rm/loss"] < seen[0][1]["rm/loss"]
    assert seen[-1][1]["rm/lr"] < 0.03 * cfg.learning_rate  # annealed towards zero
    # training does not normalise (callers fit it on reference samples): raw scale, 1 and 0
    assert (rm.gain, rm.bias) == (report.gain, report.bias) == (1.0, 0.0)
    prompts = [r.prompt for r in train] * 2
    responses = [r.chosen for r in train] + [r.rejected for r in train]
    raw = rm.score(prompts, responses)
    assert torch.equal(raw, rm.score(prompts, responses, normalised=False))
    # fitted afterwards on those responses: mean 0, std 1 there
    fit_normalisation(rm, prompts, responses)
    scores = rm.score(prompts, responses)
    assert abs(scores.mean().item()) < 1e-4 and scores.std().item() == pytest.approx(1.0, abs=1e-4)
    assert pairwise_accuracy(rm, held_out) == pytest.approx(report.eval_accuracy)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_trainable_layers_freezes_embeddings_and_lower_blocks_only(
    tmp_path: Path, kind: str
) -> None:
    backbone = llama_rm_dir(tmp_path) if kind == "llama" else bert_rm_dir(tmp_path)
    torch.manual_seed(0)
    before = RewardModel.from_pretrained(backbone).model.state_dict()
    cfg = RewardModelConfig(
        backbone=str(backbone), learning_rate=3e-3, batch_size=16, trainable_layers=1, device="cpu"
    )
    rm, report = train_reward_model(cfg, separable_rows(64, seed=0), [])
    blocks = transformer_blocks(rm.model)
    assert len(blocks) == 2 and report.steps == 4
    def names(module: torch.nn.Module) -> set[str]:
        own = {id(p) for p in module.parameters()}
        return {n for n, p in rm.model.named_parameters() if id(p) in own}

    # (frozen weights are only rounded to the compute precision: ppo_core.lm.precision)
    moved = {n for n, p in rm.model.state_dict().items() if not torch.equal(p, before[n].to(p.dtype))}
    embeddings = {n for n in before if "embed" in n}
    assert embeddings and not moved & embeddings, "embeddings were trained"
    assert names(blocks[0]) and not moved & names(blocks[0]), "the lower block was trained"
    assert names(blocks[1]) <= moved, "the top block did not train"
    # the head's bias cancels in r_chosen - r_rejected: its Bradley-Terry gradient is exactly 0
    assert {n for n in names(scalar_head(rm.model)) if n.endswith("weight")} <= moved, "the head did not train"


# --- scoring ------------------------------------------------------------------------------------


def test_causal_rm_reads_the_last_real_token_whatever_the_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(llama_rm_dir(tmp_path))
    assert not rm.text_pairs and rm.tokenizer.padding_side == "right"
    alone = rm.score(["w20"], ["w1"])
    batched = rm.score(["w20", "w21 w22 w23 w24 w25 w26"], ["w1", "w2 w3 w4"])
    assert batched[0].item() == pytest.approx(alone.item(), abs=1e-5)  # pads never read
    # the score is the head applied at the last real position
    ids = rm.encode(["w20"], ["w1"])
    hidden = rm.model.model(**ids).last_hidden_state[0, -1]
    assert alone.item() == pytest.approx(scalar_head(rm.model)(hidden).item(), abs=1e-5)


def test_mean_pooling_averages_real_tokens_and_survives_save_and_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(bert_rm_dir(tmp_path), pooling="mean")
    alone = rm.score(["w20"], ["w1"], normalised=False)
    batched = rm.score(["w20", "w21 w22 w23 w24 w25 w26"], ["w1", "w2 w3 w4"], normalised=False)
    assert batched[0].item() == pytest.approx(alone.item(), abs=1e-5)  # pads never averaged
    ids = rm.encode(["w20"], ["w1"])
    hidden = rm.model.bert(**ids).last_hidden_state[0]
    assert alone.item() == pytest.approx(rm.head(hidden.mean(0)).item(), abs=1e-5)
    cls_score = RewardModel(rm.model, rm.tokenizer, pooling="model").score(["w20"], ["w1"])
    assert abs(cls_score.item() - alone.item()) > 1e-4  # really a different read-out
    rm.save_pretrained(tmp_path / "saved")
    again = RewardModel.from_pretrained(tmp_path / "saved")
    assert again.pooling == "mean"
    assert again.score(["w20"], ["w1"], normalised=False).item() == pytest.approx(alone.item(), abs=1e-6)


def test_head_init_and_dropout_off(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(llama_rm_dir(tmp_path, hidden=256))
    head = scalar_head(rm.model)
    assert head.weight.std().item() == pytest.approx(1 / math.sqrt(257), rel=0.15)

    bert = RewardModel.from_pretrained(bert_rm_dir(tmp_path))
    assert bert.text_pairs
    assert all(m.p == 0.0 for m in bert.model.modules() if isinstance(m, torch.nn.Dropout))
    bert.model.train()
    first = bert.raw_scores(["w20 w21"], ["w1 w2"])
    assert torch.equal(first, bert.raw_scores(["w20 w21"], ["w1 w2"]))  # no dropout noise


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_save_and_load_keeps_weights_normalisation_and_format(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(
        llama_rm_dir(tmp_path) if kind == "llama" else bert_rm_dir(tmp_path)
    )
    rm.gain, rm.bias = 2.5, -0.75
    out = tmp_path / "saved"
    rm.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["reward_normalization"] == {"gain": 2.5, "bias": -0.75}
    assert config["reward_input_format"] == ("concat" if kind == "llama" else "pair")
    assert (out / "model.safetensors").exists()
    torch.manual_seed(123)  # a re-initialised head would now differ
    again = RewardModel.from_pretrained(out)
    prompts, responses = ["w20", "w21 w22"], ["w1 w3", "w7"]
    assert torch.allclose(again.score(prompts, responses), rm.score(prompts, responses), atol=1e-6)
    assert torch.allclose(
        again.score(prompts, responses),
        2.5 * rm.score(prompts, responses, normalised=False) - 0.75,
        atol=1e-5,
    )


def test_fit_normalisation_gives_mean_zero_std_one(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(llama_rm_dir(tmp_path))
    rows = separable_rows(64, seed=3)
    prompts, responses = [r.prompt for r in rows], [r.chosen for r in rows]
    raw = rm.score(prompts, responses, normalised=False)
    gain, bias = fit_normalisation(rm, prompts, responses)
    scores = rm.score(prompts, responses)
    assert abs(scores.mean().item()) < 1e-5 and scores.std().item() == pytest.approx(1.0, abs=1e-5)
    assert gain > 0 and torch.allclose(scores, gain * raw + bias, atol=1e-5)  # order kept


# --- scoring rollouts ---------------------------------------------------------------------------


def hand_rollout(
    policy_tok: PreTrainedTokenizerFast,
) -> tuple[Rollout, list[str], list[str], list[str]]:
    """Three rows: templated queries (left-padded), responses ending in EOS then pads, and a
    prompt_index into the raw prompt texts. Returns (rollout, all prompt texts, each row's
    prompt, each row's response text)."""
    prompt_texts = ["w20 w21", "w22", "w23 w24 w25"]
    responses = ["w1 w2 w3", "w5", "w30 w31"]
    index = [2, 0, 1]
    queries = [policy_tok(f"<bos> {prompt_texts[i]} w39")["input_ids"] for i in index]
    query_ids, query_mask = left_pad(queries, policy_tok.pad_token_id)
    width = 5
    ids = torch.full((3, width), policy_tok.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    for row, text in enumerate(responses):
        seq = [*policy_tok(text)["input_ids"], policy_tok.eos_token_id]
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    ended = torch.tensor([True, True, True])
    rollout = Rollout(query_ids, query_mask, ids, mask, ended, prompt_index=torch.tensor(index))
    return rollout, prompt_texts, [prompt_texts[i] for i in index], responses


@pytest.mark.parametrize("kind", ["bert", "llama-other-vocab"])
def test_scorer_through_another_tokenizer_equals_scoring_the_text(
    tmp_path: Path, kind: str
) -> None:
    policy_tok = tiny_tokenizer()
    folder = (
        bert_rm_dir(tmp_path)
        if kind == "bert"
        else llama_rm_dir(tmp_path, tokenizer=reversed_tokenizer())
    )
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(folder)
    assert rm.tokenizer.convert_tokens_to_ids("w1") != policy_tok.convert_tokens_to_ids("w1")
    rollout, texts, prompts, responses = hand_rollout(policy_tok)
    scorer = RewardScorer(rm, policy_tok, texts)
    assert not scorer.fast
    expected = rm.score(prompts, responses)
    assert torch.allclose(scorer(rollout), expected, atol=1e-5)
    assert len(set(expected.tolist())) == 3  # distinct scores: a row mix-up would be caught


def test_scorer_fast_path_with_the_policy_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy_tok = tiny_tokenizer()
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(llama_rm_dir(tmp_path))
    rollout, texts, prompts, responses = hand_rollout(policy_tok)
    expected = rm.score(prompts, responses)
    scorer = RewardScorer(rm, policy_tok, texts)
    assert scorer.fast

    def no_text(*args, **kwargs):
        raise AssertionError("fast path must not decode and re-encode")

    monkeypatch.setattr(rm, "score", no_text)
    assert torch.allclose(scorer(rollout), expected, atol=1e-5)
