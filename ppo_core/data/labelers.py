"""Generated preference pairs: sample k answers per prompt from the reference policy, then
let a labeler judge every pair.

Labelers:
- a programmatic gold scorer, `(prompts, responses) -> scores`: `vader` (the VADER sentiment
  compound of the response, in [-1, 1]) or any `module:function`. An optional Bradley-Terry
  noise model simulates human raters: a is preferred to b with probability
  sigmoid((s_a - s_b) / T) (Bradley & Terry 1952; the model the reward model itself assumes),
  so T -> 0 gives the deterministic gold ranking and T -> inf a coin flip.
- people: `export_unlabeled` writes the pairs to a JSONL that raters fill with
  "preferred": "a" | "b"; `import_labels` reads it back.

Truncations: a programmatic labeler can also judge word-boundary prefixes of each sampled
response. A pair of a response and its own prefix differs only by the words cut off, so it tells
the reward model which words moved the score: free extra labels where sampling is the expensive
part (they only enter training; rows with a truncation carry metadata "truncated": true).
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import math
import random
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ppo_core.config import SamplingConfig
from ppo_core.data.config import PromptConfig
from ppo_core.data.preferences import PreferenceRow
from ppo_core.data.prompts import encode_prompts
from ppo_core.lm.sampling import sample_responses

GoldScorer = Callable[[list[str], list[str]], list[float]]
"""(prompts, responses) -> one float per response; higher is better."""
ResponseGroup = tuple[str, list[str]]
"""A prompt and the k responses sampled for it."""

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _vader():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader_scores(texts: list[str]) -> list[float]:
    """VADER compound sentiment in [-1, 1] (Hutto & Gilbert 2014): rule-based, offline."""
    analyzer = _vader()
    return [float(analyzer.polarity_scores(text)["compound"]) for text in texts]


def vader_gold(prompts: list[str], responses: list[str]) -> list[float]:
    """The `vader` gold scorer: only the response's sentiment counts."""
    return vader_scores(responses)


def load_gold_scorer(name: str) -> GoldScorer:
    """`vader`, or `package.module:function` for any scorer with the GoldScorer signature."""
    if name == "vader":
        return vader_gold
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"labeler {name!r}: expected 'vader' or 'module:function'")
    function = getattr(importlib.import_module(module_name), attr, None)
    if not callable(function):
        raise ValueError(f"labeler {name!r}: {module_name} has no callable {attr!r}")
    return function


def sample_response_groups(
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    prompt_cfg: PromptConfig,
    k: int,
    sampling: SamplingConfig,
    batch_size: int = 32,
    seed: int = 0,
) -> list[ResponseGroup]:
    """k sampled responses per prompt, decoded without special tokens and stripped (the text a
    rater sees). Seeds the global torch RNG with `seed`; a prompt's k rows are consecutive."""
    torch.manual_seed(seed)
    encoded = encode_prompts(tokenizer, prompts, prompt_cfg)
    jobs = [i for i in range(len(prompts)) for _ in range(k)]
    rows = [encoded[i] for i in jobs]
    sampled = sample_responses(
        policy, tokenizer, rows, sampling, batch_size, progress="sampling responses"
    )
    responses: list[list[str]] = [[] for _ in prompts]
    for row, text in zip(jobs, sampled.texts, strict=True):
        responses[row].append(text.strip())
    return list(zip(prompts, responses, strict=True))


def bradley_terry_probability(score_a: float, score_b: float, temperature: float) -> float:
    """P(a preferred to b) = sigmoid((s_a - s_b) / T), computed without overflow."""
    z = (score_a - score_b) / temperature
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    return math.exp(z) / (1.0 + math.exp(z))


def word_truncations(text: str, n: int, rng: random.Random) -> list[str]:
    """Up to n distinct prefixes of `text` cut at random word ends, shortest first: each keeps
    at least two words and drops at least one, and keeps the original spacing."""
    ends = [m.end() for m in re.finditer(r"\S+", text)]
    cuts = range(2, len(ends))  # number of words kept
    return [text[: ends[c - 1]] for c in sorted(rng.sample(cuts, min(n, len(cuts))))]


def with_truncations(
    groups: Sequence[ResponseGroup], n: int, seed: int = 0
) -> list[tuple[str, list[str], int]]:
    """(prompt, responses + n truncations of each response, number of sampled responses)."""
    rng = random.Random(seed)
    return [
        (prompt, [*rs, *(t for r in rs for t in word_truncations(r, n, rng))], len(rs))
        for prompt, rs in groups
    ]


def label_pairs(
    groups: Sequence[ResponseGroup],
    scorer: GoldScorer,
    noise_temperature: float | None = None,
    seed: int = 0,
    min_score_gap: float = 0.0,
    truncations: int = 0,
) -> list[PreferenceRow]:
    """Every pair of distinct texts in each group, labelled by the gold scorer; with
    `truncations` > 0 the texts include that many word truncations of each response.

    Pairs with |s_a - s_b| < min_score_gap are dropped, and so are exact ties when labels are
    deterministic (nothing decides them). The gold scores go into the metadata so held-out
    agreement with gold can be measured later without rescoring.
    """
    expanded = with_truncations(groups, truncations, seed)  # n = 0: the responses alone
    flat_prompts = [p for p, texts, _ in expanded for _ in texts]
    flat_responses = [r for _, texts, _ in expanded for r in texts]
    scores = [float(s) for s in scorer(flat_prompts, flat_responses)]
    if len(scores) != len(flat_responses):
        raise ValueError(
            f"gold scorer returned {len(scores)} scores for {len(flat_responses)} responses"
        )
    rng = random.Random(seed)
    rows: list[PreferenceRow] = []
    offset = 0
    for prompt, responses, n_sampled in expanded:
        for i, j in itertools.combinations(range(len(responses)), 2):
            a, b = responses[i], responses[j]
            s_a, s_b = scores[offset + i], scores[offset + j]
            gap = abs(s_a - s_b)
            if not a.strip() or not b.strip() or a.strip() == b.strip() or gap < min_score_gap:
                continue
            if noise_temperature is None:
                if gap == 0.0:
                    continue
                a_wins = s_a > s_b
            else:
                a_wins = rng.random() < bradley_terry_probability(s_a, s_b, noise_temperature)
            chosen, rejected = (a, b) if a_wins else (b, a)
            s_c, s_r = (s_a, s_b) if a_wins else (s_b, s_a)
            meta: dict = {"gold_chosen": s_c, "gold_rejected": s_r}
            if j >= n_sampled:  # i < j: the pair involves a truncation
                meta["truncated"] = True
            rows.append(
                PreferenceRow(prompt=prompt, chosen=chosen, rejected=rejected, metadata=meta)
            )
        offset += len(responses)
    return rows


def export_unlabeled(groups: Sequence[ResponseGroup], path: str | Path) -> int:
    """Write every pair as {"id", "prompt", "a", "b", "preferred": null}; returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as handle:
        for g, (prompt, responses) in enumerate(groups):
            for i, j in itertools.combinations(range(len(responses)), 2):
                if responses[i].strip() == responses[j].strip():
                    continue
                item = {
                    "id": f"{g}-{i}-{j}",
                    "prompt": prompt,
                    "a": responses[i],
                    "b": responses[j],
                    "preferred": None,
                }
                handle.write(json.dumps(item, ensure_ascii=False) + "\n")
                n += 1
    return n


def import_labels(path: str | Path) -> list[PreferenceRow]:
    """Pairs whose "preferred" is "a" or "b". Unlabelled, "tie" and "skip" lines are left out
    silently; any other value is logged with its line, so a typo is seen but costs one pair."""
    rows = []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            item = json.loads(line)
            choice = str(item.get("preferred") or "").strip().lower()
            if choice in ("", "tie", "skip"):
                continue
            if choice not in ("a", "b"):
                log.warning(
                    "%s:%d: preferred=%r is not 'a' or 'b'; pair skipped", path, number, choice
                )
                continue
            chosen, rejected = (item["a"], item["b"]) if choice == "a" else (item["b"], item["a"])
            meta = {"id": item.get("id"), "labeler": "human", "row": number}
            rows.append(
                PreferenceRow(
                    prompt=item["prompt"], chosen=chosen, rejected=rejected, metadata=meta
                )
            )
    return rows
