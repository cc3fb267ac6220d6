"""Where a stage's models run: one resolver from a DeviceConfig to a device and a precision.

Every pipeline stage that loads a model puts it where `resolve_placement` says (the reference
that samples preference pairs and normalisation answers, the reward model while it trains and
while it scores rollouts, the policy, reference and critic of a PPO round, every model of the
evaluation); the batches follow the model (`module_device`). Only the reference snapshot stays
on the CPU on purpose: it converts and writes files and runs no forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from ppo_core.config import DeviceConfig
from ppo_core.lm.models import pick_device
from ppo_core.lm.precision import resolve_precision

M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class Placement:
    """A device, the compute dtype there, and why that dtype (for logs and run records)."""

    device: torch.device
    dtype: torch.dtype = torch.float32
    reason: str = ""

    def place(self, module: M) -> M:
        """A model that trains, on this device (the same object, moved in place; its weights stay
        fp32: precision.MasterWeights, or FSDP2's mixed-precision policy, give it the compute dtype)."""
        return module.to(self.device)

    def freeze(self, module: M) -> M:
        """A model that only runs forwards: on this device with compute-dtype weights, in eval
        mode, without gradients."""
        self.place(module).to(self.dtype).eval()
        module.requires_grad_(False)
        return module


def resolve_placement(cfg: DeviceConfig) -> Placement:
    """`auto` is CUDA when torch sees a GPU, else the CPU; the precision as precision.py resolves it."""
    device = pick_device(cfg.device)
    dtype, reason = resolve_precision(cfg.precision, device)
    return Placement(device, dtype, reason)
