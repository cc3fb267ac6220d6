"""Data-parallel PPO over processes (launched by torchrun), exact with respect to one process.

Each rank rolls out its share of the global batch (global positions rank, rank + W, ...) with
its own sampling seed. Everything that one process computes over the whole batch is reduced
over ranks, so the update equals a single process's update on the same samples:

- reward / advantage whitening: the valid-token count, sum and squared deviations are summed;
- the minibatch split: every rank draws the same permutation of the global batch and keeps the
  rows it holds, so minibatch j has the same members as in one process;
- the loss normaliser (the minibatch's token count N) is the global count, and gradients are
  SUM-reduced: sum_r grad(sum_{tokens of r} l_t / N) = grad(sum_t l_t / N), the one-process
  gradient (plain DDP, a mean over ranks of per-rank means, is exact only for equal token counts);
- the KL controller sees the global mean sequence KL.

Gradients are reduced by torch's DistributedDataParallel (`GradientSync`), bucket by bucket
while the backward is still running, with these choices:

- SUM, not mean: DDP's default reduction divides each bucket by W, so a communication hook
  that all-reduces the bucket with SUM and returns it untouched replaces it. Scaling each
  rank's loss by W instead would let DDP compute sum_r (W g_r) / W, which equals sum_r g_r only
  when W is a power of two: otherwise the product, the quotient and every backward op carrying
  the scaled gradient round differently. The hook leaves each rank's backward exactly as one
  process runs it and only adds, for any W (the old hand-written buckets did the same sum).
- One DDP over the policy and the value module together (the separate critic, or the head on
  the policy's shared trunk): one forward, one backward, one set of buckets, so a trunk feeding
  both the policy and the value loss is reduced once. DDP reduces only parameters that require
  a gradient, so frozen weights (a LoRA policy's base) cost no communication after the initial
  broadcast. Every trainable parameter takes part in the training forward, so
  find_unused_parameters stays off (no graph search per forward; a model whose forward skips
  trainable weights fails in DDP's check, "Expected to have finished reduction in the prior
  iteration", at the next minibatch's first forward).
- DDP reduces only what runs inside its forward, and ours does not go through model.forward
  (packed rows call the trunk and the LM head themselves): the wrapped module's forward runs
  a function the trainer passes (`GradientSync.__call__`). Only the training micro-steps go
  through it; generation and old-policy / reference / reward scoring use the bare modules.
- Accumulation: all micro-batches of a minibatch but the last run inside no_sync(), so the
  accumulated gradient is all-reduced once, in the last backward. A rank holding none of a
  minibatch's rows (the shuffle can give it none) still runs one micro-step, on its own row 0
  with loss weight 0, so that every rank issues the same collectives; its gradient is zero.
- No buffer broadcast at each forward (the models have no running statistics, and ranks run
  different numbers of forwards per minibatch); parameters (frozen ones included) and buffers
  are broadcast from rank 0 once, when DDP is built. After the reduction the gradients are views
  into DDP's buckets (gradient_as_bucket_view), so autograd's copies are freed before the step.

Ranks therefore hold identical weights and optimiser states after every step; only rank 0
writes checkpoints and logs.

`DataParallel.sharding == "fsdp"` keeps everything above but the replicas: the policy and the
value module are sharded over the ranks with FSDP2 instead of wrapped in DDP (ppo_core.lm.sharding,
whose `ShardedTraining` takes GradientSync's place; its checkpoints: ppo_core.lm.dcp_checkpoint).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel group; the default is a single process."""

    rank: int = 0
    world_size: int = 1
    sharding: str = "none"
    """`none`: every rank holds the whole models (DDP); `fsdp`: the trained ones are sharded."""

    @classmethod
    def from_env(cls, timeout_s: float = 1800.0, sharding: str = "none") -> DataParallel:
        """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...): NCCL on
        GPUs, gloo on CPU. Without those variables: one process, no group (and no sharding)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), sharding)

    @property
    def sharded(self) -> bool:
        return self.enabled and self.sharding == "fsdp"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check_batch(self, batch_size: int, mini_batch_size: int) -> None:
        """Every rank must hold the same number of rollouts."""
        if batch_size % self.world_size:
            raise ValueError(
                f"ppo.algo.batch_size ({batch_size}) must be divisible by the number of "
                f"data-parallel processes ({self.world_size})"
            )
        if mini_batch_size < self.world_size:
            raise ValueError(
                f"mini-batch size ({mini_batch_size}) is smaller than the number of "
                f"data-parallel processes ({self.world_size})"
            )

    def local_slice(self, global_items: list[int]) -> list[int]:
        """This rank's share of a global batch: positions rank, rank + W, ..."""
        return global_items[self.rank :: self.world_size]

    def local_rows(self, global_positions: torch.Tensor) -> torch.Tensor:
        """Local row indices of the global batch positions this rank holds (see local_slice)."""
        mine = global_positions[global_positions % self.world_size == self.rank]
        return mine // self.world_size

    # ---- collectives (no-ops in one process) ---------------------------------------------
    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return tensor
        out = tensor.detach().clone()
        if dist.get_backend() == "nccl" and out.device.type != "cuda":
            out = out.cuda()  # NCCL reduces GPU tensors only (metric dicts are built on the CPU)
        dist.all_reduce(out)
        return out.to(tensor.device)

    def max_int(self, value: int) -> int:
        """The largest of the ranks' values."""
        if not self.enabled:
            return value
        out = torch.tensor([value], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return int(out.item())

    def sum_floats(self, stats: dict[str, float]) -> dict[str, float]:
        """Sum each value over ranks; every rank must pass the same keys."""
        if not self.enabled or not stats:
            return stats
        keys = sorted(stats)
        values = self.sum(torch.tensor([stats[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, values.tolist(), strict=True))

    def mean_floats(self, stats: dict[str, float]) -> dict[str, float]:
        return {k: v / self.world_size for k, v in self.sum_floats(stats).items()}

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


class _TrainingForward(nn.Module):
    """The modules a training step differentiates, as the one module DDP wraps; its forward
    runs whatever function the caller passes, which reaches the modules as it likes."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


def _sum_hook(sync, bucket):  # unannotated: DDP rejects the string annotations of this module
    """DDP communication hook (GradientSync, dist.GradBucket) -> Future[Tensor]: all-reduce the
    bucket with SUM, no division by the world size."""
    if bucket.index() == 0:
        sync.reductions += 1
    work = dist.all_reduce(bucket.buffer(), group=sync.ddp.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class GradientSync:
    """Gradient reduction for the training step: DistributedDataParallel over `modules` with a
    SUM hook (see the module docstring); in one process a pass-through.

    Build it on every rank at the same point (it broadcasts rank 0's weights), run the training
    forward through `__call__`, and iterate a minibatch's micro-batches with `micro_batches`."""

    def __init__(self, dp: DataParallel, modules: Sequence[nn.Module | None]) -> None:
        self.reductions = 0  # backward passes whose gradients DDP all-reduced (bucket 0 counted)
        self.ddp: DistributedDataParallel | None = None
        if dp.enabled:
            self.ddp = DistributedDataParallel(
                _TrainingForward([m for m in modules if m is not None]),
                forward_sync_buffers=False,
                gradient_as_bucket_view=True,
            )
            self.ddp.register_comm_hook(self, _sum_hook)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) inside DDP's forward, so that the backward of its outputs reduces gradients."""
        return fn(*args) if self.ddp is None else self.ddp(fn, *args)

    def micro_batches(self, rows: torch.Tensor, size: int) -> Iterator[tuple[torch.Tensor, float]]:
        """This rank's micro-batches of a minibatch as (local rows, loss weight); the loop body
        runs the forward and backward. All but the last run under no_sync(): DDP all-reduces
        once, in the last backward. A rank with no rows yields its row 0 with weight 0, so it
        joins that all-reduce with a zero gradient (one process is never given no rows)."""
        chunks = rows.split(size) if len(rows) else (rows.new_zeros(1),)
        weight = 1.0 if len(rows) else 0.0
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            with contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync():
                yield chunk, weight

    def gathered(self) -> contextlib.AbstractContextManager:
        """Whole weights for generation and scoring: every rank already holds them."""
        return contextlib.nullcontext()


def shutdown() -> None:
    """Leave the process group (torchrun expects every rank to exit cleanly)."""
    if dist.is_initialized():
        dist.destroy_process_group()
