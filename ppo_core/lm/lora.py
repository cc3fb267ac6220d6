"""LoRA adapters (peft) on the policy and the critic: config, wrapping, adapter-only state.

With `ppo.lora` the policy is the frozen base plus trainable low-rank adapters, and the
reference is the same base with the adapters switched off (peft's `disable_adapter`), so the
base is in memory once. A separate critic gets adapters of its own, injected in place into its
own backbone (its module types stay those of transformers), and trains them with its value
head. Checkpoints then hold only what trains (`trainable_state_dict`): adapters and heads.

Dropout is not configurable: PPO needs the log-probs of one policy to be deterministic (the
ratio is exactly 1 before the first update), so every dropout, adapters' included, is off.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ppo_core.config import StrictModel


class LoRAConfig(StrictModel):
    """Low-rank adapters instead of full fine-tuning of the policy (and a separate critic)."""

    r: int = Field(16, ge=1, le=1024)
    """Adapter rank."""
    alpha: float = Field(32.0, gt=0.0)
    """Scale numerator: the update is (alpha / r) * B A."""
    target_modules: list[str] | Literal["all-linear"] | None = None
    """Names (or name suffixes) of the linear layers that get adapters. None: peft's default for
    the architecture (q_proj and v_proj for Llama, Qwen2, Mistral, Gemma); "all-linear": every
    linear layer but the output head."""

    def peft_config(self, task_type: str | None):
        from peft import LoraConfig

        return LoraConfig(
            r=self.r, lora_alpha=self.alpha, lora_dropout=0.0, target_modules=self.target_modules,
            task_type=task_type, bias="none",
        )


def check_target_modules(model: nn.Module, cfg: LoRAConfig) -> None:
    """Every named target must match a linear layer of `model`; raises ValueError naming the
    ones that match none (peft would otherwise fail deep inside, or silently adapt nothing)."""
    if not isinstance(cfg.target_modules, list):
        return
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    missing = [t for t in cfg.target_modules if not any(re.search(rf"(^|\.){re.escape(t)}$", n) for n in linear)]
    if missing:
        examples = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ValueError(f"target_modules {missing} match no linear layer of {type(model).__name__} (it has {examples})")


def add_policy_adapters(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """The causal LM wrapped by peft with fresh adapters (B = 0: it starts as the base)."""
    from peft import get_peft_model

    check_target_modules(model, cfg)
    return get_peft_model(model, cfg.peft_config("CAUSAL_LM"))


def add_adapters_in_place(backbone: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Inject adapters into `backbone` itself (no wrapper) and freeze all but them."""
    from peft import inject_adapter_in_model

    check_target_modules(backbone, cfg)
    config = cfg.peft_config(None)
    if config.target_modules is None:  # peft's per-architecture default, as get_peft_model finds it
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        config.target_modules = set(DEFAULTS[backbone.config.model_type])
    inject_adapter_in_model(config, backbone)
    for name, param in backbone.named_parameters():
        param.requires_grad_("lora_" in name)
    return backbone


def trainable_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train, by state-dict name: the whole state of a fully trained module,
    the adapters (and heads) of one with frozen parts."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    if len(trainable) == sum(1 for _ in module.parameters()):
        return module.state_dict()
    return {k: v.detach() for k, v in module.state_dict(keep_vars=True).items() if id(v) in trainable}


def load_trainable_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what `trainable_state_dict` wrote; every trainable parameter must be in it."""
    expected = set(trainable_state_dict(module))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise KeyError(f"checkpoint does not match the trainable parameters: missing {missing[:5]}, unexpected {extra[:5]}")
    module.load_state_dict(state, strict=len(state) == len(module.state_dict()))
