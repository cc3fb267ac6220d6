"""The tiny PPO run of tests/test_distributed.py, in one process or as a torchrun rank.

Responses are a fixed function of (prompt index, iteration) instead of samples, so a run in W
processes sees exactly the samples one process sees and the two must train identically.
CRITIC is `separate` (full fine-tuning, a critic model, packed forwards) or `shared` (a LoRA policy
on a frozen base, which is also the reference, a value head on its trunk, and gradient
checkpointing, which takes the plain forward).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.dist_worker OUT ITERS CRITIC
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ppo_core.config import DeviceConfig, SamplingConfig
from ppo_core.lm.distributed import DataParallel, shutdown
from ppo_core.lm.rollout import Rollout, left_pad
from ppo_core.ppo.config import KLConfig, PPOConfig
from ppo_core.ppo.experience import Experience
from ppo_core.ppo.trainer import PPOTrainer
from ppo_core.ppo.value import CriticModel
from tests.conftest import make_prompts
from tests.tiny import tiny_llama, tiny_tokenizer

CONFIG = PPOConfig(
    batch_size=8,
    num_mini_batches=2,
    ppo_epochs=2,
    micro_batch_size=1,  # accumulation, and minibatches split unevenly over ranks
    learning_rate=3e-3,
    lr_schedule="constant",
    whiten_rewards=True,
    kl=KLConfig(init_coef=0.1, target=1.0, horizon=100),  # adaptive: beta depends on the global KL
)


# the metrics a data-parallel run must reproduce (to float rounding: tests/test_distributed.py)
EXACT_KEYS = (
    "objective/scores",
    "objective/kl",
    "objective/kl_coef",
    "loss/policy",
    "loss/value",
    "policy/approxkl",
    "policy/clipfrac",
    "optim/grad_norm_policy",
    "optim/grad_norm_critic",
)


def varied_score(rollout: Rollout) -> torch.Tensor:
    """Tokens divisible by 3 count +1, length costs 0.3 per token: every row scores differently."""
    mask = rollout.response_mask.float()
    return ((rollout.response_ids % 3 == 0).float() * mask).sum(1) - 0.3 * mask.sum(1)


class FixedResponseTrainer(PPOTrainer):
    """Response of prompt i at iteration k: 1..6 tokens from a fixed formula, every third ending in EOS.
    Also records what tests/test_distributed.py checks about the gradient reduction: this rank's
    token count in each minibatch, the number of micro-steps, and the first minibatch's reduced
    gradients (before clipping)."""

    local_tokens: tuple[int, ...] = ()
    micro_steps = 0
    first_grads: dict[str, torch.Tensor] | None = None

    def _minibatch_step(self, exp: Experience, rows: torch.Tensor) -> dict[str, float]:
        self.local_tokens = (*self.local_tokens, int(exp.mask[rows].sum()))
        return super()._minibatch_step(exp, rows)

    def _micro_step(self, mb: Experience, n_tokens: float, weight: float = 1.0) -> dict[str, float]:
        self.micro_steps += 1
        return super()._micro_step(mb, n_tokens, weight)

    def _step_models(self, loss_finite: bool) -> tuple[tuple[float, float], bool]:
        if self.first_grads is None:  # the reduced gradients, before any moves to the masters
            value = self.value_module.named_parameters(prefix="value")
            named = [*self.policy.named_parameters(), *value]
            self.first_grads = {k: p.grad.detach().clone() for k, p in named if p.grad is not None}
        return super()._step_models(loss_finite)

    def _rollout(self) -> Rollout:
        indices = self.dp.local_slice(self.sampler.batch(self.iteration))
        query_ids, query_mask = left_pad([self.prompts[i] for i in indices], self.pad_id)
        eos, width = int(self.tokenizer.eos_token_id), 6
        responses, ended = [], []
        for i in indices:
            length = 1 + (5 * i + self.iteration) % width
            tokens = [4 + (7 * i + 3 * t + self.iteration) % 40 for t in range(length)]
            if i % 3 == 0:
                tokens[-1] = eos
            responses.append(tokens)
            ended.append(i % 3 == 0)
        response_ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((len(indices), width), dtype=torch.long)
        for row, tokens in enumerate(responses):
            response_ids[row, : len(tokens)] = torch.tensor(tokens)
            response_mask[row, : len(tokens)] = 1
        rollout = Rollout(query_ids, query_mask, response_ids, response_mask, torch.tensor(ended))
        rollout.prompt_index = torch.tensor(indices)
        return rollout.trimmed()


def lora_policy() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: random non-zero adapters, the same in every process
    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    return get_peft_model(tiny_llama(seed=0), lora)


def build(
    parallel: DataParallel | None = None, critic: str = "separate", cls: type[PPOTrainer] = FixedResponseTrainer
) -> PPOTrainer:
    """The tiny trainer; `cls=PPOTrainer` samples its responses instead (tests/fsdp_worker.py)."""
    shared = critic == "shared"
    policy = lora_policy() if shared else tiny_llama(seed=0)
    return cls(
        CONFIG.model_copy(update={"critic": critic}),
        SamplingConfig(max_new_tokens=6),
        policy,
        None if shared else tiny_llama(seed=0),
        None if shared else CriticModel.from_model(policy),
        tiny_tokenizer(),
        varied_score,
        make_prompts(24),
        device=DeviceConfig(precision="fp32", gradient_checkpointing=shared),  # exact comparisons
        parallel=parallel,
    )


def _weights(trainer: PPOTrainer) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "policy": {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()},
        "value": {k: v.detach().clone() for k, v in trainer.value_module.state_dict().items()},
    }


# global batch positions of the one-sided minibatch: with 2 processes all of them are rank 0's
ONE_SIDED = torch.tensor([0, 2, 4, 6])


def one_sided_minibatch(parallel: DataParallel | None, critic: str) -> dict:
    """One minibatch step whose rows all live on rank 0 (rank 1 holds none of them)."""
    trainer = build(parallel, critic)
    rollout = trainer._rollout()
    exp = trainer._experience(rollout, trainer.score_fn(rollout).float())
    stats = trainer._minibatch_step(exp, trainer.dp.local_rows(ONE_SIDED))
    return {"stats": stats, "local_tokens": trainer.local_tokens, **_weights(trainer)}


def run(
    out: Path, iterations: int, parallel: DataParallel | None = None, critic: str = "separate"
) -> None:
    trainer = build(parallel, critic)
    history = [trainer.step() for _ in range(iterations)]
    trainer.save(out / "checkpoints")
    ddp = trainer.grad_sync.ddp
    state = {
        "history": history,
        **_weights(trainer),
        "kl_coef": trainer.kl_ctl.value,
        "local_tokens": trainer.local_tokens,
        "micro_steps": trainer.micro_steps,
        "first_grads": trainer.first_grads,
        "ddp": {
            "wrapped": isinstance(ddp, DistributedDataParallel),
            "comm_hook": None if ddp is None else ddp._get_ddp_logging_data().get("comm_hook"),
            "reductions": trainer.grad_sync.reductions,
        },
        "one_sided": one_sided_minibatch(parallel, critic),
    }
    torch.save(state, out / f"rank{trainer.dp.rank}.pt")


if __name__ == "__main__":
    parallel = DataParallel.from_env()
    try:
        run(Path(sys.argv[1]), int(sys.argv[2]), parallel, sys.argv[3])
    finally:
        shutdown()
