"""Continue a saved PPO run in a fresh process (used by test_checkpoint.py).

    python -m tests.resume_worker CHECKPOINT_ROOT OUT_DIR ITERATIONS

Builds the trainer exactly as the test does, restores it with PPOTrainer.load, trains until
ITERATIONS, and writes the metrics of the resumed iterations (metrics.json) and the final policy
weights (policy.safetensors) to OUT_DIR. A new process proves that everything a resume needs
is on disk, not left behind in the memory of the process that saved it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from ppo_core.config import SamplingConfig
from ppo_core.ppo.config import KLConfig
from ppo_core.ppo.trainer import PPOTrainer
from tests.conftest import build_trainer

TOTAL_ITERATIONS = 4
VOLATILE = ("time/", "throughput/")


def comparable(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics a resumed run must reproduce exactly (timings and throughputs vary)."""
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def make_resume_trainer(critic: str = "separate", precision: str = "fp32") -> PPOTrainer:
    """Adaptive KL and a linear LR schedule, so a resume that lost their state would drift."""
    return build_trainer(
        sampling=SamplingConfig(max_new_tokens=6),
        batch_size=8,
        num_mini_batches=2,
        ppo_epochs=2,
        learning_rate=3e-3,
        lr_schedule="linear",
        total_iterations=TOTAL_ITERATIONS,
        kl=KLConfig(init_coef=0.1, target=0.5, horizon=50),
        seed=7,
        critic=critic,
        precision=precision,
    )


def policy_state(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().clone() for k, v in trainer.policy.state_dict().items()}


def main(root: str, out_dir: str, iterations: int) -> None:
    torch.set_num_threads(1)
    trainer = make_resume_trainer()
    if not trainer.load(root):
        raise SystemExit(f"no checkpoint under {root}")
    start = trainer.iteration
    history = trainer.train(iterations)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({"start": start, "history": history}))
    save_file(policy_state(trainer), str(out / "policy.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
