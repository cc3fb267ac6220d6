"""The sharded (`sharding="fsdp"`) runs of tests/test_fsdp.py, as torchrun ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.fsdp_worker OUT train
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.fsdp_worker OUT resume PLAIN

train: for each critic (separate; shared: value head on a LoRA trunk with gradient checkpointing)
ITERATIONS iterations on dist_worker's fixed responses (compared with one process), checkpointed
every iteration under OUT/fixed-CRITIC; ITERATIONS on sampled responses (generation with sharded
weights, the ranks' responses ending at different lengths) with the shared critic, under
OUT/sampled; one minibatch whose rows all live on rank 0.
resume: the sampled run again, in new processes, from OUT/crashed (the test copies its checkpoint
of iteration ITERATIONS - 1 there, as a crash right after it would leave it), and a plain
one-process checkpoint (PLAIN) continued sharded.
Rank r writes OUT/MODE-rank{r}.pt: whole weights (gathered), histories, and the checks' numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ppo_core.lm.distributed import DataParallel, shutdown
from ppo_core.lm.sharding import ShardedTraining, full_state_dict
from ppo_core.ppo.trainer import PPOTrainer
from tests.dist_worker import ONE_SIDED, FixedResponseTrainer, build

ITERATIONS = 3
CRITICS = ("separate", "shared")
SAMPLED = "shared"  # LoRA: the reference is the sharded policy's base


def whole(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Gathered copies (a collective for DTensors: every rank calls it, in the same order)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in tensors.items()}


def weights(trainer: PPOTrainer) -> dict[str, dict[str, torch.Tensor]]:
    return {"policy": full_state_dict(trainer.policy), "value": full_state_dict(trainer.value_module)}


def holdings(trainer: PPOTrainer) -> dict[str, int]:
    """Elements this rank holds of the trained parameters and of their AdamW moments, and in all."""
    params = [p for opt in trainer.optimizers for p in opt.param_groups[0]["params"]]
    moments = [s["exp_avg"] for opt in trainer.optimizers for s in opt.state.values()]
    return {
        "local_params": sum(p.to_local().numel() for p in params),
        "local_moments": sum(m.to_local().numel() for m in moments),
        "params": sum(p.numel() for p in params),
        "all_dtensors": all(isinstance(t, DTensor) for t in [*params, *moments]),
    }


def run(trainer: PPOTrainer, checkpoints: Path | None = None) -> dict[str, Any]:
    history = []
    while trainer.iteration < ITERATIONS:
        history.append(trainer.step())
        if checkpoints is not None:
            trainer.save(checkpoints)
    out = {"history": history, **weights(trainer), "kl_coef": trainer.kl_ctl.value, **holdings(trainer)}
    if isinstance(trainer, FixedResponseTrainer):
        out.update(first_grads=whole(trainer.first_grads), local_tokens=trainer.local_tokens,
                   micro_steps=trainer.micro_steps, reductions=trainer.grad_sync.reductions)
    return out


def one_sided(parallel: DataParallel) -> dict[str, Any]:
    """One minibatch step whose rows all live on rank 0 (rank 1 pads with weight-0 micro-steps)."""
    trainer = build(parallel, "separate")
    rollout = trainer._rollout()
    exp = trainer._experience(rollout, trainer.score_fn(rollout).float())
    stats = trainer._minibatch_step(exp, trainer.dp.local_rows(ONE_SIDED))
    return {"stats": stats, "micro_steps": trainer.micro_steps, **weights(trainer)}


def train(out: Path, parallel: DataParallel) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for critic in CRITICS:
        trainer = build(parallel, critic)
        assert isinstance(trainer.grad_sync, ShardedTraining)
        results[f"fixed-{critic}"] = run(trainer, out / f"fixed-{critic}")
    results["sampled"] = run(build(parallel, SAMPLED, PPOTrainer), out / "sampled")
    results["one_sided"] = one_sided(parallel)
    return results


def resume(out: Path, parallel: DataParallel, plain: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    trainer = build(parallel, SAMPLED, PPOTrainer)
    results["loaded"] = str(trainer.load(out / "crashed"))
    results["sampled"] = run(trainer, out / "crashed")
    trainer = build(parallel, "separate")
    results["loaded-plain"] = str(trainer.load(plain))
    results["from-plain"] = run(trainer)
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]
    dp = DataParallel.from_env(sharding="fsdp")
    try:
        result = train(out_dir, dp) if mode == "train" else resume(out_dir, dp, Path(sys.argv[3]))
        torch.save(result, out_dir / f"{mode}-rank{dp.rank}.pt")
    finally:
        shutdown()
