"""Data-parallel PPO over processes (launched by torchrun), exact with respect to one process.

Each rank rolls out its share of the global batch (global positions rank, rank + W, ...) with
its own sampling seed. Everything that one process computes over the whole batch is reduced
over ranks, so the update equals a single process's update on the same samples:

- reward / advantage whitening: the valid-token count, sum and squared deviations are summed;
- the minibatch split: every rank draws the same permutation of the global batch and keeps the
  rows it holds, so minibatch j has the same members as in one process;
- the loss normaliser (the minibatch's token count) is the global count, and gradients are
  SUM-reduced: sum_r grad(sum_{tokens of r} l_t / N) = grad(sum_t l_t / N), the one-process
  gradient (plain DDP averages, which would be exact only for equal token counts);
- the KL controller sees the global mean sequence KL.

Ranks therefore hold identical weights and optimiser states after every step; only rank 0
writes checkpoints and logs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

_BUCKET = 32 * 1024 * 1024  # elements per gradient all-reduce: bounded extra memory


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel group; the default is a single process."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls, timeout_s: float = 1800.0) -> DataParallel:
        """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...): NCCL on
        GPUs, gloo on CPU. Without those variables: one process, no group."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size())

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

    def sum_floats(self, stats: dict[str, float]) -> dict[str, float]:
        """Sum each value over ranks; every rank must pass the same keys."""
        if not self.enabled or not stats:
            return stats
        keys = sorted(stats)
        values = self.sum(torch.tensor([stats[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, values.tolist(), strict=True))

    def mean_floats(self, stats: dict[str, float]) -> dict[str, float]:
        return {k: v / self.world_size for k, v in self.sum_floats(stats).items()}

    def sync_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """SUM-reduce gradients in flat buckets; a rank without rows this step sends zeros."""
        if not self.enabled:
            return
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[nn.Parameter] = []
        size = 0
        for p in params:
            bucket.append(p)
            size += p.numel()
            if size >= _BUCKET:
                _all_reduce_grads(bucket)
                bucket, size = [], 0
        if bucket:
            _all_reduce_grads(bucket)

    def broadcast_parameters(self, modules: Iterable[nn.Module | None]) -> None:
        """Start every rank from rank 0's weights, whatever each process loaded."""
        if not self.enabled:
            return
        for module in modules:
            if module is None:
                continue
            for tensor in (*module.parameters(), *module.buffers()):
                dist.broadcast(tensor.data, src=0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def _all_reduce_grads(params: list[nn.Parameter]) -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def shutdown() -> None:
    """Leave the process group (torchrun expects every rank to exit cleanly)."""
    if dist.is_initialized():
        dist.destroy_process_group()
