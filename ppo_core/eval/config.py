"""Settings of held-out evaluation: how many prompts and samples, the gold scorer, and the
promotion gates that decide the `champion`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ppo_core.config import SamplingConfig, StrictModel


class GateConfig(StrictModel):
    """Promotion gates: the evaluated policy becomes `champion` only if every configured gate holds."""

    min_gold_margin: float | None = None
    """Gold reward must exceed the reference's by at least this much (None: no gold gate)."""
    min_proxy_margin: float | None = None
    """Proxy reward must exceed the reference's by at least this much (None: no proxy gate)."""
    max_kl: float | None = Field(None, gt=0.0)
    """Mean sequence KL to the reference (nats) must not exceed this (None: no KL budget)."""
    kl_estimator: Literal["exact", "k1", "k3"] = "exact"
    """Which KL estimate the budget applies to."""
    promote: Literal["final", "best_round"] = "final"
    """Which policy the gates decide on. `final`: the last round's. `best_round`: of the
    evaluated rounds that pass every gate, the one with the highest gold reward (proxy without
    gold): the checkpoint before over-optimisation or before the KL budget ran out (Gao et al.'s
    early stopping). It is picked on the held-out prompts it is reported on, so with many
    rounds its reported gain is slightly optimistic."""


class EvaluationConfig(StrictModel):
    """Held-out evaluation of each round and the final policy."""

    n_prompts: int = Field(64, ge=1)
    """Held-out prompts to evaluate on (at most the held-out split's size)."""
    samples_per_prompt: int = Field(1, ge=1)
    """Responses sampled per prompt for the reference and each policy. The standard error of a
    gold mean falls as 1/sqrt(this) until prompt-to-prompt spread dominates; the cost grows
    linearly (generation and exact KL)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling for evaluation responses."""
    batch_size: int = Field(16, ge=1)
    """Responses sampled at once (prompts x samples laid out in one list). Larger batches
    generate more tokens per second until memory or cores run out (SmolLM2 fp32 on 2 CPU cores:
    93 tokens/s at 16 rows, 178 at 32; tests/bench/README.md); the samples depend on it."""
    gold_scorer: str | None = "vader"
    """Gold scorer ("vader" or "module:function"); None when there is none."""
    per_round: bool = True
    """Also evaluate every round's checkpoint (for the over-optimisation plot)."""
    gates: GateConfig = Field(default_factory=GateConfig)
    """Promotion gates for the `champion` alias."""
    n_samples_shown: int = Field(4, ge=0)
    """Sample pairs shown side by side in the report."""
