"""ppo_core: PPO for causal language models, as a plain library (torch + transformers).

Packages by concern: `lm` (loading, rollout, log-probs, packing, checkpoints, data
parallelism), `ppo` (the algorithm), `data` (prompts, preferences, labelers), `reward` (the
reward model), `eval` (KL and reward evaluation, report, plots).

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
    "EvaluationConfig": "ppo_core.eval.config",
    "GateConfig": "ppo_core.eval.config",
    "KLConfig": "ppo_core.ppo.config",
    "NonFiniteError": "ppo_core.ppo.trainer",
    "PPOConfig": "ppo_core.ppo.config",
    "PPOTrainer": "ppo_core.ppo.trainer",
    "PromptConfig": "ppo_core.data.config",
    "RewardModel": "ppo_core.reward.model",
    "RewardModelConfig": "ppo_core.reward.config",
    "Rollout": "ppo_core.lm.rollout",
    "SamplingConfig": "ppo_core.config",
    "SharedValueHead": "ppo_core.ppo.value",
    "evaluate_policy": "ppo_core.eval.evaluate",
    "evaluate_reference": "ppo_core.eval.evaluate",
    "generate": "ppo_core.lm.rollout",
    "load_causal_lm": "ppo_core.lm.models",
    "load_tokenizer": "ppo_core.lm.models",
    "train_reward_model": "ppo_core.reward.training",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ppo_core' has no attribute {name!r}")
