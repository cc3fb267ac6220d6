"""The tiny PPO run of tests/test_distributed.py, in one process or as a torchrun rank.

Responses are a fixed function of (prompt index, iteration) instead of samples, so a run in W
processes sees exactly the samples one process sees and the two must train identically.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.dist_worker OUT ITERS
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ppo_core.config import SamplingConfig
from ppo_core.lm.distributed import DataParallel, shutdown
from ppo_core.lm.rollout import Rollout, left_pad
from ppo_core.ppo.config import KLConfig, PPOConfig
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


def varied_score(rollout: Rollout) -> torch.Tensor:
    """Tokens divisible by 3 count +1, length costs 0.3 per token: every row scores differently."""
    mask = rollout.response_mask.float()
    return ((rollout.response_ids % 3 == 0).float() * mask).sum(1) - 0.3 * mask.sum(1)


class FixedResponseTrainer(PPOTrainer):
    """Response of prompt i at iteration k: 1..6 tokens from a fixed formula, every third ending in EOS."""

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


def build(parallel: DataParallel | None = None) -> FixedResponseTrainer:
    policy = tiny_llama(seed=0)
    return FixedResponseTrainer(
        CONFIG,
        SamplingConfig(max_new_tokens=6),
        policy,
        tiny_llama(seed=0),
        CriticModel.from_model(policy),
        tiny_tokenizer(),
        varied_score,
        make_prompts(24),
        parallel=parallel,
    )


def run(out: Path, iterations: int, parallel: DataParallel | None = None) -> None:
    trainer = build(parallel)
    history = [trainer.step() for _ in range(iterations)]
    trainer.save(out / "checkpoints")
    state = {
        "history": history,
        "policy": {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()},
        "critic": {k: v.detach().clone() for k, v in trainer.critic.state_dict().items()},
        "kl_coef": trainer.kl_ctl.value,
    }
    rank = trainer.dp.rank
    torch.save(state, out / f"rank{rank}.pt")


if __name__ == "__main__":
    parallel = DataParallel.from_env()
    try:
        run(Path(sys.argv[1]), int(sys.argv[2]), parallel)
    finally:
        shutdown()
