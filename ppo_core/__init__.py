"""ppo_core: PPO for causal language models, as a plain library (torch + transformers).

No orchestration or tracking imports live here; metrics leave through a callback.
"""

from ppo_core.config import DeviceConfig, KLConfig, PPOConfig, SamplingConfig
from ppo_core.rollout import Rollout, generate
from ppo_core.trainer import NonFiniteError, PPOTrainer
from ppo_core.value import CriticModel

__version__ = "0.1.0"

__all__ = [
    "CriticModel",
    "DeviceConfig",
    "KLConfig",
    "NonFiniteError",
    "PPOConfig",
    "PPOTrainer",
    "Rollout",
    "SamplingConfig",
    "__version__",
    "generate",
]
