"""PNG figures of a PPO run: over-optimisation across rounds and training curves per iteration.

Rendered with matplotlib's Agg backend (no display needed) into small figures meant for an
MLflow artifact or a README.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after matplotlib.use: the backend must be chosen first

from ppo_core.eval.report import EvalReport

DEFAULT_CURVE_KEYS = (
    "objective/scores",
    "objective/kl",
    "objective/rlhf_reward",
    "objective/kl_coef",
)


def sqrt_kl(kl: float) -> float:
    """sqrt(KL), the x axis of Gao et al. 2022 (gold reward is close to a function of it); a
    slightly negative k1 estimate is clipped to 0."""
    return math.sqrt(max(kl, 0.0))


def plot_overoptimisation(
    report: EvalReport, path: str | Path, kl_estimator: str = "exact"
) -> Path:
    """Gold and proxy reward (+- one standard error) against sqrt(KL to the reference) across
    rounds (reference at 0); a dotted line marks the best round.

    Gao et al. 2022, "Scaling Laws for Reward Model Overoptimization": the proxy keeps rising
    with sqrt(KL) while the gold score peaks and falls; the two scores have different units, so
    each gets its own panel over a shared x axis.
    """
    history = report.history()
    if report.final is not None and report.final not in report.rounds.values():
        history = {**history, "final": report.final}
    labels = [str(k) if k != 0 else "ref" for k in history]
    x = [sqrt_kl(e.kl(kl_estimator)) for e in history.values()]
    has_gold = all(e.gold_reward is not None for e in history.values())
    panels = 2 if has_gold else 1
    fig, axes = plt.subplots(panels, 1, figsize=(5, 2.3 * panels + 0.6), sharex=True, squeeze=False)
    evals = list(history.values())
    series = [
        (
            "proxy reward (RM)",
            [e.proxy_reward for e in evals],
            [e.proxy_reward_se for e in evals],
            "tab:blue",
        )
    ]
    if has_gold:
        gold = [e.gold_reward for e in evals]
        series.insert(
            0, ("gold reward", gold, [e.gold_reward_se or 0.0 for e in evals], "tab:orange")
        )
    for ax, (name, y, se, color) in zip(axes[:, 0], series, strict=True):
        ax.errorbar(x, y, yerr=se, fmt="-o", color=color, markersize=4, capsize=2, linewidth=1.2)
        for xi, yi, label in zip(x, y, labels, strict=True):
            ax.annotate(label, (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    if report.best_round is not None and report.best_round in report.rounds:
        best = report.rounds[report.best_round]
        for ax in axes[:, 0]:
            ax.axvline(sqrt_kl(best.kl(kl_estimator)), color="grey", linestyle=":", linewidth=1)
    axes[-1, 0].set_xlabel(f"sqrt(KL to reference) [sqrt nats], {kl_estimator} estimate")
    title = "Over-optimisation across rounds"
    if report.reward_hacking:
        title += " — reward hacking flagged"
    axes[0, 0].set_title(title, fontsize=10)
    return _save(fig, path)


def plot_training_curves(
    history: Sequence[Mapping[str, float]],
    path: str | Path,
    keys: Sequence[str] = DEFAULT_CURVE_KEYS,
    round_starts: Sequence[int] = (),
) -> Path:
    """One panel per metric key over PPO iterations (1-based), from the dicts the trainer emits;
    keys absent from every dict are skipped. `round_starts` draws a dashed line where each
    pipeline round began (iteration numbers)."""
    present = [k for k in keys if any(k in h for h in history)]
    if not present:
        raise ValueError(f"none of the keys {list(keys)} appear in the metric history")
    fig, axes = plt.subplots(
        len(present), 1, figsize=(5, 1.6 * len(present) + 0.6), sharex=True, squeeze=False
    )
    for ax, key in zip(axes[:, 0], present, strict=True):
        points = [(i + 1, h[key]) for i, h in enumerate(history) if key in h]
        ax.plot([p[0] for p in points], [p[1] for p in points], "-", marker=".", markersize=3)
        for start in round_starts:
            ax.axvline(start, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylabel(key.split("/")[-1], fontsize=8)
        ax.set_title(key, fontsize=8, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("PPO iteration")
    return _save(fig, path)


def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path
