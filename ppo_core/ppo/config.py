"""Settings of the PPO algorithm: one iteration's sizes, optimiser, GAE, clipping, and the KL
leash to the reference. Every range is checked at construction time."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ppo_core.config import StrictModel


class KLConfig(StrictModel):
    """The leash to the frozen reference policy."""

    estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator on samples of pi, with log r = log pi - log pi_ref: k1 = log r,
    k2 = (log r)^2 / 2, k3 = (1/r - 1) + log r (Schulman, "Approximating KL divergence")."""
    init_coef: float = Field(0.05, ge=0.0)
    """Initial KL coefficient beta."""
    target: float | None = Field(None, gt=0.0)
    """Target sequence KL (nats) for the adaptive controller of Ziegler et al. 2019; None keeps beta fixed."""
    horizon: int = Field(10000, gt=0)
    """Adaptive controller horizon, in samples (the default is Ziegler et al.'s): beta moves by at
    most 20% x batch_size / horizon per iteration, so by at most a factor exp(0.2 N / horizon)
    over N samples. A run much shorter than the horizon leaves beta near init_coef; give such a
    run a horizon of a few batches."""
    in_reward: bool = True
    """True: -beta*KL_t is added to every token's reward (InstructGPT). False: beta*KL is a loss term."""


class PPOConfig(StrictModel):
    """One PPO iteration: rollout, score, rewards, advantages, then K epochs of minibatch updates."""

    batch_size: int = Field(8, ge=1)
    """Prompts (= rollouts) per PPO iteration."""
    num_mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch; batch_size must be divisible by it."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per forward/backward (gradient accumulation); None = the whole minibatch."""
    ppo_epochs: int = Field(4, ge=1)
    """Passes (K) over the rollout batch, each with a fresh shuffle."""
    learning_rate: float = Field(1e-5, gt=0.0)
    """Policy AdamW learning rate."""
    critic_learning_rate: float | None = Field(None, gt=0.0)
    """Critic learning rate; None uses learning_rate."""
    adam_eps: float = Field(1e-5, gt=0.0)
    """AdamW epsilon (1e-5 as in the PPO implementation-details studies)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    lr_schedule: Literal["linear", "constant"] = "linear"
    """Linear anneal to zero over total_iterations, or constant."""
    total_iterations: int = Field(1, ge=1)
    """Iterations the LR schedule spans (the whole run, across pipeline rounds)."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Global gradient-norm clip per model; None disables."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount over response tokens."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda."""
    cliprange: float = Field(0.2, gt=0.0, lt=1.0)
    """Policy ratio clip epsilon."""
    cliprange_value: float | None = Field(0.2, gt=0.0)
    """Value clip around the rollout values; None disables value clipping."""
    vf_coef: float = Field(0.1, ge=0.0)
    """Weight of the value loss in the summed loss (a separate critic also has its own optimizer and LR)."""
    ent_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """KL penalty settings."""
    whiten_rewards: bool = False
    """Scale per-token rewards to unit variance over valid tokens (no mean shift)."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over valid tokens."""
    score_clip: float | None = Field(None, gt=0.0)
    """Clip the sequence score to [-score_clip, score_clip]; None disables."""
    missing_eos_penalty: float | None = Field(None, ge=0.0)
    """Subtracted from the score of responses that never emitted a stop token ("EOS trick")."""
    target_kl_early_stop: float | None = Field(None, gt=0.0)
    """Stop the epoch loop once the minibatch approx KL (k3) exceeds this; None never stops."""
    critic: Literal["separate", "shared"] = "separate"
    """A separate critic model with a scalar head, or a value head on the policy trunk."""
    max_consecutive_nonfinite: int = Field(3, ge=1)
    """Skipped optimizer steps (non-finite loss/grad) in a row before the run stops."""
    logprob_chunk_size: int = Field(4096, ge=1)
    """Rows of logits turned into log-probs at once; bounds the memory of the vocab softmax."""
    logprobs_from_generation: bool = True
    """Take the old policy log-probs from the generation logits instead of a second forward.
    Exact in fp32; set False under bf16, where cached and full forwards differ slightly."""
    pack_sequences: bool = True
    """Scoring and update forwards run on packed rows: no pad tokens, and the prompt prefix all
    rows share (a chat template's system prompt) once per packed row instead of once per row.
    Same math (ppo_core.lm.packing); off, or a model packing cannot serve exactly, is the plain
    forward over the padded batch."""
    seed: int = 0
    """Seed for sampling, shuffling and initialisation."""

    @model_validator(mode="after")
    def _divisible(self) -> PPOConfig:
        if self.batch_size % self.num_mini_batches:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by num_mini_batches ({self.num_mini_batches})"
            )
        mini = self.batch_size // self.num_mini_batches
        if self.micro_batch_size is not None and mini % self.micro_batch_size:
            raise ValueError(
                f"mini-batch size ({mini}) must be divisible by micro_batch_size ({self.micro_batch_size})"
            )
        return self

    @property
    def mini_batch_size(self) -> int:
        return self.batch_size // self.num_mini_batches

    @property
    def effective_micro_batch_size(self) -> int:
        return self.micro_batch_size or self.mini_batch_size
