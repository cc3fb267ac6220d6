"""Module weights as safetensors (never pickles): tied parameters are stored once."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn


def save_module(module: nn.Module, path: str | Path) -> None:
    save_model(module, str(path))


def load_module(module: nn.Module, path: str | Path, device: torch.device | str = "cpu") -> None:
    missing, unexpected = load_model(module, str(path), strict=True, device=str(device))
    if missing or unexpected:  # strict=True raises first; this is belt and braces
        raise RuntimeError(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
