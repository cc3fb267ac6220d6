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

M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class Placement:
    """A device, and the autocast dtype used there (None: full precision)."""

    device: torch.device
    autocast_dtype: torch.dtype | None = None

    def place(self, module: M) -> M:
        """`module` on this placement's device (the same object, moved in place)."""
        return module.to(self.device)


def resolve_placement(cfg: DeviceConfig) -> Placement:
    """`auto` is CUDA when torch sees a GPU, else the CPU; bf16 autocast only on CUDA."""
    device = pick_device(cfg.device)
    return Placement(device, torch.bfloat16 if cfg.bf16 and device.type == "cuda" else None)
