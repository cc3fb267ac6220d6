"""The learned judge r_phi: a sequence classifier with one output, its own tokenizer, and a
normalisation (gain, bias) stored in its config so every consumer reads the same scale.

How (prompt, response) becomes model input depends on the tokenizer:
- encoder tokenizers with [CLS]/[SEP] (BERT, MiniLM, RoBERTa, DeBERTa): a text pair
  `[CLS] prompt [SEP] response [SEP]`, with segment ids, read through the model's own pooling;
- causal tokenizers: tokens(prompt) + tokens(response), right-padded. The head then reads the
  rightmost token that is not `pad_token_id` (transformers' sequence-classification heads do
  this for either padding side), which is the last response token. Right padding keeps
  position ids 0..n-1 on the real tokens, so a score never depends on the batch it is in.
Truncation keeps the end of the sequence (causal) or trims the longer text (pairs), because the
score is read at the end.

Normalised score = gain * raw + bias (lm-human-preferences): after `fit_normalisation` the
reference policy's responses score mean 0, std 1, so PPO's KL coefficient has a fixed meaning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import (
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ppo_core.lm.models import (
    ModelSource,
    _pretrained_args,
    disable_dropout,
    eval_mode,
    load_tokenizer,
    resolve_source,
)
from ppo_core.lm.rollout import Rollout

NORMALIZATION_KEY = "reward_normalization"
INPUT_FORMAT_KEY = "reward_input_format"
MAX_LENGTH_KEY = "reward_max_length"
POOLING_KEY = "reward_pooling"
Pooling = Literal["model", "mean"]


def scalar_head(model: nn.Module) -> nn.Linear:
    """The output projection to one logit: the last Linear with one output feature
    (`classifier` in BERT, `score` in Llama-style heads, `classifier.out_proj` in RoBERTa)."""
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == 1]
    if not heads:
        raise ValueError(f"{type(model).__name__} has no Linear layer with one output")
    return heads[-1]


def init_head(head: nn.Linear) -> None:
    """w ~ N(0, 1/sqrt(d+1)), b = 0 (lm-human-preferences): the initial rewards have unit-ish
    scale whatever the hidden size d."""
    nn.init.normal_(head.weight, std=1.0 / math.sqrt(head.in_features + 1))
    if head.bias is not None:
        nn.init.zeros_(head.bias)


def uses_text_pairs(tokenizer: PreTrainedTokenizerBase) -> bool:
    return tokenizer.sep_token is not None and tokenizer.cls_token is not None


class RewardModel(nn.Module):
    """r_phi(prompt, response) -> scalar; see the module docstring for the input layout."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        gain: float = 1.0,
        bias: float = 0.0,
        max_length: int = 512,
        pooling: Pooling | None = None,
    ) -> None:
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.head = scalar_head(model)
        self.pooling: Pooling = pooling or getattr(model.config, POOLING_KEY, None) or "model"
        self.gain, self.bias, self.max_length = float(gain), float(bias), max_length
        fmt = getattr(model.config, INPUT_FORMAT_KEY, None)
        self.text_pairs = fmt == "pair" if fmt is not None else uses_text_pairs(tokenizer)
        if not self.text_pairs:
            tokenizer.padding_side = "right"
        if tokenizer.pad_token_id is None:
            raise ValueError("reward model tokenizer has no pad token")
        # causal heads read the rightmost token that is not pad_token_id: it must be set
        model.config.pad_token_id = tokenizer.pad_token_id

    @classmethod
    def from_pretrained(
        cls,
        path_or_source: str | Path | ModelSource,
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
        max_length: int | None = None,
        pooling: Pooling | None = None,
    ) -> RewardModel:
        """Any sequence-classification checkpoint (or a bare backbone, which gets a fresh head).

        A head the checkpoint lacks (or whose size is not 1) is initialised N(0, 1/sqrt(d+1));
        call torch.manual_seed first for a reproducible head. `max_length` None keeps the one
        the model was saved with (512 for a fresh backbone); `pooling` None likewise ("model").
        """
        src = (
            path_or_source
            if isinstance(path_or_source, ModelSource)
            else resolve_source(str(path_or_source))
        )
        location, kwargs = _pretrained_args(src, trust_remote_code)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            location, num_labels=1, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs
        )
        head = scalar_head(model)
        head_names = {
            n for n, p in model.named_parameters() if any(p is q for q in head.parameters())
        }
        fresh = {
            str(k[0] if isinstance(k, tuple) else k)
            for k in (*info["missing_keys"], *info["mismatched_keys"])
        }
        if head_names & fresh:
            init_head(head)
        disable_dropout(model)
        model.to(device)
        norm = getattr(model.config, NORMALIZATION_KEY, None) or {}
        tokenizer = load_tokenizer(src, trust_remote_code=trust_remote_code)
        max_length = max_length or getattr(model.config, MAX_LENGTH_KEY, None) or 512
        max_length = min(max_length, getattr(model.config, "max_position_embeddings", max_length))
        return cls(model, tokenizer, norm.get("gain", 1.0), norm.get("bias", 0.0), max_length, pooling)

    def save_pretrained(self, directory: str | Path) -> None:
        """A plain Hugging Face folder (safetensors + tokenizer) with the normalisation and the
        input format in config.json."""
        config = self.model.config
        setattr(config, NORMALIZATION_KEY, {"gain": self.gain, "bias": self.bias})
        setattr(config, INPUT_FORMAT_KEY, "pair" if self.text_pairs else "concat")
        setattr(config, MAX_LENGTH_KEY, self.max_length)
        setattr(config, POOLING_KEY, self.pooling)
        self.model.save_pretrained(str(directory))
        self.tokenizer.save_pretrained(str(directory))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def normalise(self, raw: torch.Tensor) -> torch.Tensor:
        return raw * self.gain + self.bias

    # --- inputs -----------------------------------------------------------------------------
    def prompt_ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def response_ids(self, response: str) -> list[int]:
        return self.tokenizer(response, add_special_tokens=False)["input_ids"]

    def pad_sequences(self, sequences: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """Right-pad token lists (each cut to its last max_length tokens) into a batch."""
        seqs = [list(s)[-self.max_length :] for s in sequences]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> dict[str, torch.Tensor]:
        if self.text_pairs:
            return dict(
                self.tokenizer(
                    list(prompts),
                    list(responses),
                    truncation="longest_first",
                    max_length=self.max_length,
                    padding=True,
                    return_tensors="pt",
                )
            )
        return self.pad_sequences(
            [
                self.prompt_ids(p) + self.response_ids(r)
                for p, r in zip(prompts, responses, strict=True)
            ]
        )

    # --- scores -----------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Raw scores [N] of an encoded batch (with gradients when training)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if self.pooling == "model":
            return self.model(**batch).logits[:, 0].float()
        # mean of the final hidden states over real tokens, then the scalar head: how
        # sentence-embedding encoders (all-MiniLM-L6-v2) were trained to summarise a text;
        # their [CLS] pooler never was
        hidden = self.model.base_model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(pooled.to(self.head.weight.dtype))[:, 0].float()

    def raw_scores(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        return self.forward(self.encode(prompts, responses))

    @torch.no_grad()
    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        batch_size: int = 32,
        normalised: bool = True,
    ) -> torch.Tensor:
        """Scores [N] on the CPU, in batches."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        with eval_mode(self.model):
            out = [
                self.raw_scores(prompts[s : s + batch_size], responses[s : s + batch_size]).cpu()
                for s in range(0, len(prompts), batch_size)
            ]
        raw = torch.cat(out) if out else torch.zeros(0)
        return self.normalise(raw) if normalised else raw

    @torch.no_grad()
    def score_token_ids(
        self, sequences: Sequence[Sequence[int]], batch_size: int = 32, normalised: bool = True
    ) -> torch.Tensor:
        """Scores of already tokenised prompt+response sequences (causal format only)."""
        with eval_mode(self.model):
            out = [
                self.forward(self.pad_sequences(sequences[s : s + batch_size])).cpu()
                for s in range(0, len(sequences), batch_size)
            ]
        raw = torch.cat(out) if out else torch.zeros(0)
        return self.normalise(raw) if normalised else raw


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    return a is b or (type(a) is type(b) and a.get_vocab() == b.get_vocab())


class RewardScorer:
    """A `ppo_core.ppo.experience.ScoreFn` backed by a reward model.

    The prompt is the raw text `prompt_texts[rollout.prompt_index]` (never the chat-templated
    query the policy saw); the response is the masked response tokens without special tokens.
    With another tokenizer they are decoded and re-tokenised by the RM; when the RM uses the
    policy's own tokenizer the response ids are scored directly.
    """

    def __init__(
        self,
        rm: RewardModel,
        policy_tokenizer: PreTrainedTokenizerBase,
        prompt_texts: Sequence[str],
        batch_size: int = 32,
    ) -> None:
        self.rm, self.tokenizer, self.prompt_texts = rm, policy_tokenizer, list(prompt_texts)
        self.batch_size = batch_size
        self.fast = not rm.text_pairs and same_tokenizer(rm.tokenizer, policy_tokenizer)
        self._special = set(policy_tokenizer.all_special_ids)
        self._prompt_cache: dict[str, list[int]] = {}

    def _prompts(self, rollout: Rollout) -> list[str]:
        if rollout.prompt_index is None:  # no raw text: fall back to the decoded query
            return [
                self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                for ids, mask in zip(rollout.query_ids, rollout.query_mask, strict=True)
            ]
        return [self.prompt_texts[int(i)] for i in rollout.prompt_index]

    def _response_ids(self, rollout: Rollout) -> list[list[int]]:
        return [
            [t for t in ids[mask.bool()].tolist() if t not in self._special]
            for ids, mask in zip(rollout.response_ids, rollout.response_mask, strict=True)
        ]

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        prompts = self._prompts(rollout)
        responses = self._response_ids(rollout)
        if self.fast:
            sequences = [
                self._cached_prompt(p) + r for p, r in zip(prompts, responses, strict=True)
            ]
            scores = self.rm.score_token_ids(sequences, self.batch_size)
        else:
            texts = [
                t.strip() for t in self.tokenizer.batch_decode(responses, skip_special_tokens=True)
            ]
            scores = self.rm.score(prompts, texts, self.batch_size)
        return scores.to(rollout.response_ids.device)

    def _cached_prompt(self, prompt: str) -> list[int]:
        if prompt not in self._prompt_cache:
            self._prompt_cache[prompt] = self.rm.prompt_ids(prompt)
        return self._prompt_cache[prompt]
