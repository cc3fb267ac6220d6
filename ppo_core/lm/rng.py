"""The random-number state a resumed run needs to continue bit for bit."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state(shuffle: torch.Generator) -> dict[str, Any]:
    """torch's CPU (and CUDA) generators, Python's, and a private generator (`shuffle`)."""
    return {"torch": torch.get_rng_state(), "shuffle": shuffle.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def load_rng_state(state: dict[str, Any], shuffle: torch.Generator) -> None:
    """Restore what `rng_state` returned (the CUDA part only where there is CUDA)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    shuffle.set_state(state["shuffle"])
    random.setstate(state["python"])
