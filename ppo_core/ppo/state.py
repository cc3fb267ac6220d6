"""Saving and restoring a PPOTrainer: everything a resumed run needs to continue bit for bit.

Policy and critic weights (safetensors), optimiser and scheduler states, the KL controller,
every RNG the run draws from (torch CPU/CUDA, the minibatch shuffle, python's random) and the
iteration counter, written through `atomic_checkpoint`, so a crash never leaves a half
checkpoint that loads.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ppo_core.lm.checkpoint import (
    atomic_checkpoint,
    latest_checkpoint,
    load_json,
    load_state,
    save_json,
    save_state,
)
from ppo_core.lm.weights import load_module, save_module

if TYPE_CHECKING:
    from ppo_core.ppo.trainer import PPOTrainer


def _value_module(trainer: PPOTrainer) -> torch.nn.Module:
    return trainer.critic if trainer.critic is not None else trainer.shared_head


def checkpoint_name(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def save_trainer_state(trainer: PPOTrainer, root: str | Path) -> Path:
    name = checkpoint_name(trainer.iteration)
    with atomic_checkpoint(root, name) as tmp:
        save_module(trainer.policy, tmp / "policy.safetensors")
        save_module(_value_module(trainer), tmp / "value.safetensors")
        save_state(tmp / "optim.pt", {
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "schedulers": [s.state_dict() for s in trainer.schedulers],
        })
        save_state(tmp / "rng.pt", {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "shuffle": trainer.shuffle_gen.get_state(),
        })
        save_json(tmp / "trainer.json", {
            "iteration": trainer.iteration,
            "consecutive_skips": trainer.consecutive_skips,
            "kl_controller": trainer.kl_ctl.state_dict(),
            "python_random": repr(random.getstate()),
        })
    return Path(root) / name


def load_trainer_state(trainer: PPOTrainer, root_or_folder: str | Path) -> bool:
    folder = Path(root_or_folder)
    if not (folder / "trainer.json").exists():
        found = latest_checkpoint(folder)
        if found is None:
            return False
        folder = found
    load_module(trainer.policy, folder / "policy.safetensors", trainer.device)
    load_module(_value_module(trainer), folder / "value.safetensors", trainer.device)
    optim = load_state(folder / "optim.pt")
    for opt, state in zip(trainer.optimizers, optim["optimizers"], strict=True):
        opt.load_state_dict(state)
    for sched, state in zip(trainer.schedulers, optim["schedulers"], strict=True):
        sched.load_state_dict(state)
    rng = load_state(folder / "rng.pt")
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    trainer.shuffle_gen.set_state(rng["shuffle"])
    meta = load_json(folder / "trainer.json")
    trainer.iteration = int(meta["iteration"])
    trainer.consecutive_skips = int(meta["consecutive_skips"])
    trainer.kl_ctl.load_state_dict(meta["kl_controller"])
    random.setstate(ast.literal_eval(meta["python_random"]))
    return True
