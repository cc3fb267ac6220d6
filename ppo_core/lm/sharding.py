"""Sharded data-parallel PPO (`ppo.sharding: fsdp`): the policy and the value module sharded over
the ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`), exact with respect to one process
as DDP is (ppo_core.lm.distributed: global token count as the loss normaliser, gradients summed).

Each rank keeps 1/W of every trained parameter, of its gradient and of its AdamW moments (DTensors
sharded on dim 0); a block's whole weights exist only while it runs. The choices:

- Wrapping: `fully_shard` on every transformer block of the policy and of a separate critic (the
  children of each model's largest ModuleList), then on one root module that holds both models
  (`_TrainingForward`, the module DDP wraps in `none` mode). The root's group is what is left:
  embeddings, final norms, the LM head, the critic's head, and the shared value head, so the head
  on the policy's trunk is trained by the same backward and reduced with the same reduce-scatter
  as the trunk's last weights, exactly like any other parameter (no side all-reduce). Our
  forwards do not go through model.forward (packed rows call the trunk and the LM head
  themselves), so as with DDP the training forward runs a function inside the root's forward,
  where the root's group is gathered; blocks gather their own weights in their forward (and again
  in the backward: reshard_after_forward=True), the root keeps its weights until the backward.
- Exact sums: FSDP's reduce-scatter averages (divides by W) by default. The divide factor is set
  to 1 and the reduction forced to a plain SUM (`set_gradient_divide_factor(1.0)`,
  `set_force_sum_reduction_for_comms(True)`: a factor of 1 is then skipped, not applied), so each
  shard's gradient is sum_r grad(sum_{tokens of r} l_t / N), the one-process gradient, and every
  rank's backward is the one-process backward. Scaling the loss by W instead would round
  differently for any W that is not a power of two (see ppo_core.lm.distributed).
- Accumulation: every micro-batch's backward reduce-scatters (gradients stay sharded, which is
  what `fsdp` is for; `set_requires_gradient_sync(False)` would keep a whole fp32 gradient per
  rank until the minibatch's last backward). Forwards and backwards are collectives (all-gathers),
  so every rank must run the same number of micro-steps: a rank with fewer rows in a minibatch
  (the shuffle splits it unevenly) runs extra micro-steps on its row 0 with loss weight 0, which add
  exact zeros. Unused trainable parameters are reduce-scattered as zeros, so the reduce-scatters of
  all ranks always match.
- Generation and scoring (rollout, old / reference log-probs, values): `gathered()` all-gathers
  every unit once and keeps the weights whole for the whole phase (reshard_after_forward off), so
  the many forwards of `model.generate` (a number that differs between ranks, whose responses end
  at different lengths) issue no collective at all; on exit everything is resharded and FSDP's
  per-iteration records of those forwards are dropped (`reset_iter_state`: its backward prefetch
  would otherwise follow forward orders that differ between ranks). Peak memory is then the whole
  weights, as with DDP or with veRL / OpenRLHF handing the gathered weights to their inference
  engine; gradients and optimizer states stay sharded throughout.
- Precision: on CUDA with bf16 precision (orchestration.device.precision), MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32):
  fp32 sharded master weights, bf16 gathered weights and compute, gradients reduced in fp32. On the
  CPU everything stays fp32, so 2 gloo processes match one process to float rounding.
- Frozen models are not sharded: the reference of a LoRA policy is its own (sharded) base, and a
  separate reference and the reward model are replicated, in the compute dtype (flows.workers:
  Placement.freeze, bf16 on CUDA). They need no gradients or optimizer states (the 12 of 16 bytes
  per parameter that sharding saves; in bf16 a replica costs 2), and replicated their forwards
  are local: the reward scorer's batching and the number of reference forwards need not match
  between ranks, and no all-gather traffic is spent on them.
- Initial weights: rank 0's parameters and buffers are broadcast before sharding (as DDP does), so
  ranks that built their models differently (random adapters) still shard one model.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ppo_core.lm.distributed import DataParallel, GradientSync, _TrainingForward


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of a model: the children of its largest ModuleList (by parameter count); none
    for a module without one (the shared value head)."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(largest)


def broadcast_from_rank0(modules: Sequence[nn.Module]) -> None:
    """Every rank's parameters and buffers become rank 0's (in place, before sharding)."""
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


class ShardedTraining:
    """FSDP2 over `modules` (the policy and the value module), with GradientSync's interface:
    run the training forward through `__call__`, iterate a minibatch with `micro_batches`, and
    generate / score inside `gathered()`. Build it on every rank at the same point, before the
    optimizers: it replaces the modules' parameters by their shards."""

    def __init__(
        self, dp: DataParallel, modules: Sequence[nn.Module | None], device: torch.device, bf16: bool = False
    ) -> None:
        self.dp = dp
        # our outputs are slices (log-probs of the response); nothing writes into them in place
        warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(FSDP_TrainingForward\) returned a view")
        self.reductions = 0  # backward passes whose gradients were reduce-scattered
        parts = [m for m in modules if m is not None]
        broadcast_from_rank0(parts)
        mesh = init_device_mesh(device.type, (dp.world_size,))
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16 and device.type == "cuda"
            else MixedPrecisionPolicy()
        )
        self.blocks: list[FSDPModule] = []
        for part in parts:
            for block in transformer_blocks(part):
                self.blocks.append(fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp))
        self.root: FSDPModule = fully_shard(
            _TrainingForward(parts), mesh=mesh, reshard_after_forward=False, mp_policy=mp
        )
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_reduce_scatter_unused_params(True, recurse=False)
        with torch.no_grad():  # FSDP picks its root at the first forward: make it ours
            self.root(lambda: None)
        self.root.reset_iter_state()

    @property
    def units(self) -> list[FSDPModule]:
        return [self.root, *self.blocks]

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) inside the root's forward (its weights gathered; see the module docstring)."""
        return self.root(fn, *args)

    def micro_batches(self, rows: torch.Tensor, size: int) -> Iterator[tuple[torch.Tensor, float]]:
        """This rank's micro-batches of a minibatch as (local rows, loss weight), as many on every
        rank: a rank with fewer yields its row 0 with weight 0 until it has as many."""
        chunks = list(rows.split(size)) if len(rows) else []
        for i in range(self.dp.max_int(len(chunks))):
            self.reductions += 1
            yield (chunks[i], 1.0) if i < len(chunks) else (rows.new_zeros(1), 0.0)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Whole weights on every rank for the duration (no_grad forwards only: generation and
        scoring), then sharded again; the forwards inside issue no collective."""
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            for unit in self.units:  # the same all-gathers, in the same order, on every rank
                unit.unshard()
            yield
        finally:
            for unit in self.blocks:
                unit.set_reshard_after_forward(True, recurse=False)
            self.root.reset_iter_state()  # reshard all; forget the forwards (rank-dependent)


def gradient_sync(
    dp: DataParallel, modules: Sequence[nn.Module | None], device: torch.device, bf16: bool = False
) -> GradientSync | ShardedTraining:
    """What reduces the training step's gradients: FSDP2 when `dp.sharded`, else DDP (or nothing)."""
    if dp.sharded:
        return ShardedTraining(dp, modules, device, bf16)
    return GradientSync(dp, modules)


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP sharded (some of) the module's parameters (the shared value head's are in
    the root's group: the head itself is no FSDPModule)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a (possibly sharded) module on rank 0, on the CPU; {} on the other
    ranks. A collective when sharded: every rank must call it."""
    if not is_sharded(module):
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
