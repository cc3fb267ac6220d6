"""Training r_phi on preference pairs with the Bradley-Terry loss, evaluating it, and fitting
its normalisation.

Bradley-Terry: P(chosen > rejected) = sigmoid(r_c - r_r), so the negative log-likelihood of
the observed preferences is -log sigmoid(r_c - r_r) (Christiano et al. 2017, Ouyang et al.
2022). A margin m (Llama 2) asks for r_c - r_r > m. The loss only sees differences, so r's
offset is free; the optional centering term coef * mean((r_c + r_r)^2) (Eisenstein et al.
2023) pins it near zero. Training leaves the scale alone: the caller fixes the scale PPO sees
with `fit_normalisation` on reference-policy samples (lm-human-preferences).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from tqdm.auto import tqdm

from ppo_core.config import DeviceConfig
from ppo_core.data.labelers import GoldScorer
from ppo_core.data.preferences import PreferenceRow
from ppo_core.data.prompts import reward_eval_prompts
from ppo_core.lm.models import freeze_below_top_blocks
from ppo_core.lm.placement import Placement, resolve_placement
from ppo_core.lm.precision import MasterWeights, prefer_eager_attention
from ppo_core.ppo.metrics import MetricsCallback
from ppo_core.reward.config import RewardModelConfig
from ppo_core.reward.model import RewardModel


class RewardTrainReport(BaseModel):
    """What one reward-model training run achieved (small, persisted by the pipeline)."""

    train_loss: float
    """Mean Bradley-Terry loss over the last epoch."""
    train_accuracy: float
    """Share of last-epoch training pairs ranked right (before the step that saw them)."""
    eval_loss: float | None
    eval_accuracy: float | None
    """Held-out pairwise accuracy against the collected labels."""
    gold_agreement: float | None
    """Held-out share of pairs the RM orders as the gold scorer does, over pairs whose gold
    scores differ by more than gold_min_gap (None without a gold scorer)."""
    n_gold_pairs: int
    n_train: int
    n_eval: int
    steps: int
    seconds: float
    gain: float
    """The RM's normalisation gain when training ended: training fits none, so 1 unless the
    backbone is a saved RM that carries its own; `fit_normalisation` sets the one PPO uses."""
    bias: float
    """Likewise the bias (0 unless the backbone carries one)."""


def bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """mean of -log sigmoid(r_c - r_r - m) (logsigmoid is stable for large |x|)."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def centering_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """mean((r_c + r_r)^2): zero when each pair's rewards sit symmetric around 0."""
    return ((r_chosen + r_rejected) ** 2).mean()


def linear_schedule(total_steps: int, warmup_steps: int = 0) -> Callable[[int], float]:
    """LR multiplier: linear warm-up to 1, then linear anneal to 0 at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def _margins(rows: Sequence[PreferenceRow], device: torch.device) -> torch.Tensor | None:
    if all(r.margin is None for r in rows):
        return None
    return torch.tensor([r.margin or 0.0 for r in rows], dtype=torch.float32, device=device)


def distinct_texts(
    rows: Sequence[PreferenceRow],
) -> tuple[list[str], list[str], list[int], list[int]]:
    """(prompts, responses, chosen index, rejected index): each distinct (prompt, response) of
    the pairs once, so a response that is in several pairs is scored once."""
    slots: dict[tuple[str, str], int] = {}
    chosen = [slots.setdefault((r.prompt, r.chosen), len(slots)) for r in rows]
    rejected = [slots.setdefault((r.prompt, r.rejected), len(slots)) for r in rows]
    return [p for p, _ in slots], [t for _, t in slots], chosen, rejected


def pair_scores(
    rm: RewardModel, rows: Sequence[PreferenceRow]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen, r_rejected) from one forward over the batch's distinct texts: in a batch of
    one prompt's pairs, each of its K responses is in K-1 pairs."""
    prompts, responses, chosen, rejected = distinct_texts(rows)
    scores = rm.raw_scores(prompts, responses)
    return scores[chosen], scores[rejected]


def split_reward_rows(
    rows: Sequence[PreferenceRow],
) -> tuple[list[PreferenceRow], list[PreferenceRow]]:
    """(training, held-out) pairs by the RM's prompt split. Held-out keeps only pairs of whole
    sampled responses: those are what PPO has the RM score, truncations are a training aid."""
    eval_prompts = reward_eval_prompts(r.prompt for r in rows)
    train = [r for r in rows if r.prompt not in eval_prompts]
    held_out = [r for r in rows if r.prompt in eval_prompts and not r.metadata.get("truncated")]
    return train, held_out


def training_units(
    rows: Sequence[PreferenceRow], group_by_prompt: bool
) -> list[list[PreferenceRow]]:
    """What one shuffle moves around: single pairs, or all the pairs of one prompt."""
    if not group_by_prompt:
        return [[row] for row in rows]
    by_prompt: dict[str, list[PreferenceRow]] = {}
    for row in rows:
        by_prompt.setdefault(row.prompt, []).append(row)
    return list(by_prompt.values())


@torch.no_grad()
def _eval_scores(
    rm: RewardModel, rows: Sequence[PreferenceRow], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    prompts, responses, chosen, rejected = distinct_texts(rows)
    scores = rm.score(prompts, responses, batch_size, normalised=False)
    return scores[chosen], scores[rejected]


def pairwise_accuracy(
    rm: RewardModel, rows: Sequence[PreferenceRow], batch_size: int = 32
) -> float:
    """Share of pairs with r(chosen) > r(rejected); an exact tie counts one half."""
    if not rows:
        return float("nan")
    r_c, r_r = _eval_scores(rm, rows, batch_size)
    return ((r_c > r_r).float() + 0.5 * (r_c == r_r).float()).mean().item()


def gold_agreement(
    rm: RewardModel,
    rows: Sequence[PreferenceRow],
    gold: GoldScorer,
    min_gap: float,
    batch_size: int = 32,
    scores: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[float | None, int]:
    """(share of pairs ordered as gold orders them, pairs counted): only |gold gap| > min_gap.
    `scores` = precomputed (r_chosen, r_rejected) of `rows`, to skip scoring them again."""
    prompts = [r.prompt for r in rows]
    g_c = torch.tensor(gold(prompts, [r.chosen for r in rows]), dtype=torch.float32)
    g_r = torch.tensor(gold(prompts, [r.rejected for r in rows]), dtype=torch.float32)
    keep = (g_c - g_r).abs() > min_gap
    if not keep.any():
        return None, 0
    r_c, r_r = scores if scores is not None else _eval_scores(rm, rows, batch_size)
    agree = torch.sign(r_c - r_r)[keep] == torch.sign(g_c - g_r)[keep]
    return agree.float().mean().item(), int(keep.sum())


def fit_normalisation(
    rm: RewardModel, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 32
) -> tuple[float, float]:
    """Set gain, bias so gain * r + bias has mean 0 and std 1 over these (reference) responses."""
    raw = rm.score(prompts, responses, batch_size, normalised=False)
    if raw.numel() < 2:
        raise ValueError("normalisation needs at least two responses")
    mean, std = raw.mean().item(), raw.std().item()
    gain = 1.0 / max(std, 1e-8)
    rm.gain, rm.bias = gain, -mean * gain
    return rm.gain, rm.bias


def _step_metrics(
    loss: torch.Tensor, r_c: torch.Tensor, r_r: torch.Tensor, lr: float
) -> dict[str, float]:
    diff = (r_c - r_r).detach()
    return {
        "rm/loss": loss.item(),
        "rm/accuracy": (diff > 0).float().mean().item(),
        "rm/margin": diff.mean().item(),
        "rm/reward_mean": torch.cat([r_c, r_r]).detach().mean().item(),
        "rm/lr": lr,
    }


def train_reward_model(
    cfg: RewardModelConfig,
    train_rows: Sequence[PreferenceRow],
    eval_rows: Sequence[PreferenceRow],
    on_metrics: MetricsCallback | None = None,
    gold_scorer: GoldScorer | None = None,
    placement: Placement | None = None,
    show_progress: bool = False,
) -> tuple[RewardModel, RewardTrainReport]:
    """AdamW with linear anneal over `epochs` passes, then held-out evaluation. The RM is not
    normalised here (whatever `cfg.normalise` says): call `fit_normalisation` on reference-policy
    samples afterwards, as the pipeline does when `cfg.normalise` is set. The RM trains on
    `placement` (default: resolved from `cfg.device`); `show_progress`: a progress bar over steps."""
    if not train_rows:
        raise ValueError("no training pairs")
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    placement = placement or resolve_placement(DeviceConfig(device=cfg.device or "auto"))
    rm = placement.place(
        RewardModel.from_pretrained(cfg.backbone, "cpu", cfg.trust_remote_code, cfg.max_length, cfg.pooling)
    )
    if cfg.trainable_layers is not None:
        freeze_below_top_blocks(rm.model, cfg.trainable_layers)
    rm.model.train()
    weights = MasterWeights.cast(rm.model, placement.dtype)  # bf16 compute, fp32 masters (or plain fp32)
    prefer_eager_attention(rm.model, placement.device, placement.dtype)
    trainable = weights.master_params()
    # fused: one kernel per step (as the PPO trainer); the default for-each AdamW takes several
    # times longer on the CPU (timings in tests/bench/README.md)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True)
    units = training_units(train_rows, cfg.group_by_prompt)
    per_step = cfg.prompts_per_step if cfg.group_by_prompt else cfg.batch_size
    steps_per_epoch = math.ceil(len(units) / per_step)
    total = steps_per_epoch * cfg.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, linear_schedule(total, int(cfg.warmup_fraction * total))
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    step, losses, hits = 0, [], []
    progress = tqdm(total=total, desc="reward model", unit="step", disable=not show_progress)
    for _epoch in range(cfg.epochs):
        losses, hits = [], []
        for batch in torch.randperm(len(units), generator=generator).split(per_step):
            rows = [row for i in batch.tolist() for row in units[i]]
            r_c, r_r = pair_scores(rm, rows)
            loss = bradley_terry_loss(r_c, r_r, _margins(rows, rm.device))
            if cfg.center_coef > 0:
                loss = loss + cfg.center_coef * centering_loss(r_c, r_r)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            weights.accumulate_grads()
            if cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            metrics = _step_metrics(loss, r_c, r_r, scheduler.get_last_lr()[0])
            optimizer.step()
            weights.publish()
            scheduler.step()
            step += 1
            progress.update()
            progress.set_postfix(loss=f"{metrics['rm/loss']:.3f}", acc=f"{metrics['rm/accuracy']:.2f}", refresh=False)
            losses.append(metrics["rm/loss"] * len(rows))
            hits.append(metrics["rm/accuracy"] * len(rows))
            if on_metrics is not None:
                on_metrics(step, metrics)
    progress.close()
    rm.model.eval()
    n_last = len(train_rows)
    eval_loss = eval_acc = agreement = None
    n_gold = 0
    if eval_rows:
        r_c, r_r = _eval_scores(rm, eval_rows, 2 * cfg.batch_size)
        eval_loss = bradley_terry_loss(r_c, r_r, _margins(eval_rows, r_c.device)).item()
        eval_acc = ((r_c > r_r).float() + 0.5 * (r_c == r_r).float()).mean().item()
        if gold_scorer is not None:
            agreement, n_gold = gold_agreement(
                rm, eval_rows, gold_scorer, cfg.gold_min_gap, scores=(r_c, r_r)
            )
    report = RewardTrainReport(
        train_loss=sum(losses) / n_last,
        train_accuracy=sum(hits) / n_last,
        eval_loss=eval_loss,
        eval_accuracy=eval_acc,
        gold_agreement=agreement,
        n_gold_pairs=n_gold,
        n_train=len(train_rows),
        n_eval=len(eval_rows),
        steps=step,
        seconds=time.perf_counter() - start,
        gain=rm.gain,
        bias=rm.bias,
    )
    return rm, report
