"""Shared base settings of the library: the strict base model, sampling and device.

Each package keeps its own config classes beside what they configure (`ppo_core.ppo.config`,
`ppo_core.data.config`, `ppo_core.reward.config`, `ppo_core.eval.config`). Every field
carries a docstring (TRL style) so that `rlhf validate` and IDEs can explain it, and every
range is checked at construction time: a bad value fails before any model is loaded, with
the field's path in the message.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    """Base for all config models: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class SamplingConfig(StrictModel):
    """How responses are sampled from the policy during rollouts."""

    max_new_tokens: int = Field(32, ge=1, le=8192)
    """Upper bound on response length in tokens."""
    min_new_tokens: int = Field(0, ge=0)
    """Stop tokens are suppressed until this many tokens were generated."""
    temperature: float = Field(1.0, gt=0.0)
    """Softmax temperature. Log-probs used by PPO are computed at the same temperature."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0 disables)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0 disables)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extra token ids that end a response, besides the tokenizer's EOS."""

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingConfig:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})"
            )
        return self


class DeviceConfig(StrictModel):
    """Where and how the models run."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = CUDA when available, else CPU."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: auto = bf16 where the device multiplies bf16 natively (Ampere+ GPUs,
    CPUs with AMX or AVX512-BF16), else fp32 (ppo_core.lm.precision). Frozen models hold bf16
    weights; trained ones compute with bf16 weights and fp32 master weights and optimizer state
    (under FSDP2: its mixed-precision policy on CUDA, fp32 on CPU)."""
    gradient_checkpointing: bool = False
    """Trade compute for activation memory on the policy and critic."""
