"""ppo_core: PPO for causal language models, as a plain library (torch + transformers).

No orchestration or tracking imports live here; metrics leave through a callback. Names are
imported lazily so that `import ppo_core` (e.g. for the version in a CLI) costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CriticModel": "ppo_core.ppo.value",
    "DeviceConfig": "ppo_core.config",
    "KLConfig": "ppo_core.config",
    "NonFiniteError": "ppo_core.ppo.trainer",
    "PPOConfig": "ppo_core.config",
    "PPOTrainer": "ppo_core.ppo.trainer",
    "Rollout": "ppo_core.lm.rollout",
    "SamplingConfig": "ppo_core.config",
    "generate": "ppo_core.lm.rollout",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ppo_core' has no attribute {name!r}")
