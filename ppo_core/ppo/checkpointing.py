"""A PPOTrainer's checkpoints, in two layouts that load into any trainer:

- plain (one process, or DDP's identical replicas): rank 0 writes `PPOTrainer.state_dict()`
  (ppo_core.lm.checkpoint: policy.safetensors, value.safetensors, optim.pt, rng.pt, trainer.json);
- sharded (`ppo.sharding: fsdp`): every rank writes its shards of the trained weights and of their
  AdamW moments with torch.distributed.checkpoint (ppo_core.lm.dcp_checkpoint), as the state dicts
  of torch.distributed.checkpoint.state_dict (parameter names as keys, frozen weights left out);
  rank 0 adds optim.pt (the optimizers' param groups, the LR schedulers), rng.pt (its RNG state),
  rng_ranks.pt (every rank's RNG state: a resumed sharded run samples what the uninterrupted one
  would have) and trainer.json.

A sharded checkpoint loads into a sharded trainer of any size (DCP reshards) and into one process
or DDP ranks (whole tensors; export and registration read the policy this way); a plain one loads
into a sharded trainer too (each rank keeps its shards of the whole tensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ppo_core.lm.checkpoint import checkpoint_name, read_checkpoint, write_checkpoint
from ppo_core.lm.dcp_checkpoint import (
    is_sharded_checkpoint,
    load_sharded,
    read_agreed_checkpoint,
    write_sharded_checkpoint,
)
from ppo_core.lm.lora import load_trainable_state_dict, trainable_state_dict
from ppo_core.lm.rng import load_rng_state, rng_state

PPOTrainer = Any  # ppo_core.ppo.trainer.PPOTrainer, which imports this module
PARTS = ("policy", "value")


def _parts(trainer: PPOTrainer) -> list[tuple[str, nn.Module, Any]]:
    return list(zip(PARTS, (trainer.policy, trainer.value_module), trainer.optimizers, strict=True))


def _weights(trainer: PPOTrainer) -> list[tuple[Any, nn.Module]]:
    """(MasterWeights, module) of the policy and the value module."""
    return list(zip(trainer.weights, (trainer.policy, trainer.value_module), strict=True))


def _all_trainable(module: nn.Module) -> bool:
    return all(p.requires_grad for p in module.parameters())


def _meta(trainer: PPOTrainer) -> dict[str, Any]:
    return {"iteration": trainer.iteration, "consecutive_skips": trainer.consecutive_skips,
            "kl_controller": trainer.kl_ctl.state_dict()}


def _load_meta(trainer: PPOTrainer, meta: dict[str, Any], schedulers: list[dict]) -> None:
    for sched, sched_state in zip(trainer.schedulers, schedulers, strict=True):
        sched.load_state_dict(sched_state)
    trainer.iteration, trainer.consecutive_skips = int(meta["iteration"]), int(meta["consecutive_skips"])
    trainer.kl_ctl.load_state_dict(meta["kl_controller"])


# ---- plain ----------------------------------------------------------------------------
def state_dict(trainer: PPOTrainer) -> dict[str, Any]:
    """PPOTrainer.state_dict: the plain layout's entries (live tensors)."""
    policy, value = (w.exact_state(trainable_state_dict(m), m) for w, m in _weights(trainer))
    return {
        # what trains: whole models, or a LoRA policy's adapters (ppo_core.lm.lora); with bf16
        # compute, their fp32 masters (ppo_core.lm.precision), so a resume continues exactly
        "policy": policy,
        "value": value,  # the critic, or the shared value head
        "optim": {"optimizers": [opt.state_dict() for opt in trainer.optimizers],
                  "schedulers": [sched.state_dict() for sched in trainer.schedulers]},
        "rng": rng_state(trainer.shuffle_gen),
        "trainer": _meta(trainer),
    }


def load_state_dict(trainer: PPOTrainer, state: dict[str, Any]) -> None:
    """PPOTrainer.load_state_dict; with data parallelism every rank then reseeds its sampling
    (the state holds rank 0's RNG, which the other ranks must not replay)."""
    if trainer.dp.sharded:
        _load_plain_into_sharded(trainer, state)
    else:
        for (weights, module), key in zip(_weights(trainer), PARTS, strict=True):
            load_trainable_state_dict(module, state[key])
            weights.load_exact_state(state[key], module)
        for opt, opt_state in zip(trainer.optimizers, state["optim"]["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
    load_rng_state(state["rng"], trainer.shuffle_gen)
    _load_meta(trainer, state["trainer"], state["optim"]["schedulers"])
    trainer._seed_rank()


def _load_plain_into_sharded(trainer: PPOTrainer, state: dict[str, Any]) -> None:
    """Whole tensors on every rank -> this rank's shards; the optimizers' states are keyed by
    parameter position in the plain layout, by name in torch's distributed state dicts."""
    for (key, model, opt), opt_state in zip(_parts(trainer), state["optim"]["optimizers"], strict=True):
        expected = set(trainable_state_dict(model))
        if set(state[key]) != expected:
            raise KeyError(f"checkpoint {key} does not match the trainable parameters: "
                           f"missing {sorted(expected - set(state[key]))[:5]}, unexpected {sorted(set(state[key]) - expected)[:5]}")
        names = [name for name, p in model.named_parameters() if p.requires_grad]  # the optimizer's order
        by_name = {
            "state": {names[int(i)]: s for i, s in opt_state["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in opt_state["param_groups"]],
        }
        options = StateDictOptions(full_state_dict=True, strict=_all_trainable(model))
        set_state_dict(model, opt, model_state_dict=dict(state[key]), optim_state_dict=by_name, options=options)


# ---- sharded --------------------------------------------------------------------------
def sharded_state(trainer: PPOTrainer) -> tuple[dict[str, Any], list[list[dict]]]:
    """({policy, value, optim_policy, optim_value}: tensors only, DTensors where sharded; the
    optimizers' param groups). A fresh optimizer gets its (zero) state first, so the result is
    also the structure a load fills."""
    tensors, groups = {}, []
    options = StateDictOptions(ignore_frozen_params=True)
    for key, model, opt in _parts(trainer):
        model_state, opt_state = get_state_dict(model, opt, options=options)
        tensors[key], tensors[f"optim_{key}"] = model_state, {"state": opt_state["state"]}
        groups.append(opt_state["param_groups"])
    return tensors, groups


def _all_rng_states(trainer: PPOTrainer) -> list[dict[str, Any]]:
    states: list[Any] = [None] * trainer.dp.world_size
    dist.all_gather_object(states, rng_state(trainer.shuffle_gen))
    return states


def _load_sharded(trainer: PPOTrainer, folder: Path, entries: dict[str, Any]) -> None:
    tensors, _ = sharded_state(trainer)
    load_sharded(folder, tensors)
    for (key, model, opt), groups in zip(_parts(trainer), entries["optim"]["param_groups"], strict=True):
        options = StateDictOptions(strict=_all_trainable(model))
        opt_state = {"state": tensors[f"optim_{key}"]["state"], "param_groups": groups}
        set_state_dict(model, opt, model_state_dict=tensors[key], optim_state_dict=opt_state, options=options)
    ranks = entries.get("rng_ranks")
    same_ranks = ranks is not None and len(ranks) == trainer.dp.world_size
    load_rng_state(ranks[trainer.dp.rank] if same_ranks else entries["rng"], trainer.shuffle_gen)
    _load_meta(trainer, entries["trainer"], entries["optim"]["schedulers"])
    if not same_ranks:
        trainer._seed_rank()  # another number of ranks: rank 0's state is no rank's own


# ---- files ----------------------------------------------------------------------------
def save(trainer: PPOTrainer, root: str | Path) -> Path:
    """PPOTrainer.save: root/iter-NNNNNN, atomically; plain (rank 0 writes, ranks hold identical
    states, the others wait) or, for a sharded trainer, sharded (every rank writes)."""
    name = checkpoint_name(trainer.iteration)
    if trainer.dp.sharded:
        tensors, groups = sharded_state(trainer)
        entries = {
            "optim": {"param_groups": groups, "schedulers": [s.state_dict() for s in trainer.schedulers]},
            "rng": rng_state(trainer.shuffle_gen),
            "rng_ranks": _all_rng_states(trainer),
            "trainer": _meta(trainer),
        }
        return write_sharded_checkpoint(root, name, tensors, entries)
    if trainer.dp.is_main:
        write_checkpoint(root, name, trainer.state_dict())
    trainer.dp.barrier()
    return Path(root) / name


def load(trainer: PPOTrainer, root_or_folder: str | Path) -> Path | None:
    """PPOTrainer.load: from a checkpoint folder or a root (its `latest`, else its newest intact
    checkpoint), of either layout; the folder loaded, None when there is none. A sharded trainer's
    ranks all read the checkpoint rank 0 chose."""
    read = read_agreed_checkpoint if trainer.dp.sharded else read_checkpoint
    found = read(root_or_folder, trainer.device)
    if found is None:
        return None
    if is_sharded_checkpoint(found.folder):
        _load_sharded(trainer, found.folder, found.state)
    else:
        trainer.load_state_dict(found.state)
    return found.folder
