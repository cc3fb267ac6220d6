"""The critic V_psi(s_t): a scalar value for every state of a response.

Two shapes (both read the policy's own tokens, so the critic must share its vocabulary):
- `CriticModel`: a separate backbone (initialised from the policy or a reward model that uses
  the policy's tokenizer) with a zero-initialised linear head; its own optimizer. The default.
- `SharedValueHead`: a head on the policy's last hidden state; cheaper, but value and policy
  gradients then share a trunk (weighted by vf_coef).
A zero head means every initial value is 0, so the first advantages are plain discounted
rewards instead of noise from a random head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel

from ppo_core.lm.models import trunk
from ppo_core.lm.packing import response_states

HEAD_FILE = "value_head.safetensors"


def zero_head(hidden_size: int) -> nn.Linear:
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def _response_values(hidden: torch.Tensor, head: nn.Linear, response_len: int) -> torch.Tensor:
    """V(s_t) for the state before each response token: positions P-1 .. P+R-2."""
    states = hidden[:, -response_len - 1 : -1, :]
    return head(states.to(head.weight.dtype)).squeeze(-1).float()


class CriticModel(nn.Module):
    """A transformer backbone (no LM head) plus a scalar value head."""

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = zero_head(backbone.config.hidden_size)
        self.head.to(next(backbone.parameters()).dtype)

    @classmethod
    def from_pretrained(
        cls, location: str | Path, trust_remote_code: bool = False, **kwargs
    ) -> CriticModel:
        """Backbone from any causal-LM, sequence-classifier or base checkpoint; a saved critic
        (with its head file) is restored whole."""
        backbone = AutoModel.from_pretrained(location, trust_remote_code=trust_remote_code, **kwargs)
        critic = cls(backbone)
        head_path = Path(location) / HEAD_FILE
        if head_path.exists():
            critic.head.load_state_dict(load_file(str(head_path)))
        return critic

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> CriticModel:
        """A critic whose backbone copies the trunk of an already loaded model."""
        config = AutoConfig.for_model(**model.config.to_dict())
        backbone = AutoModel.from_config(config)
        backbone.load_state_dict(trunk(model).state_dict())
        backbone.to(next(model.parameters()).dtype)
        return cls(backbone)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int, packed: bool = True
    ) -> torch.Tensor:
        _, hidden = response_states(self.backbone, input_ids, attention_mask, response_len + 1, False, packed)
        return _response_values(hidden, self.head, response_len)

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.backbone.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()}, str(directory / HEAD_FILE))
        (directory / "critic.json").write_text(json.dumps({"kind": "CriticModel"}))

    def gradient_checkpointing_enable(self) -> None:
        self.backbone.gradient_checkpointing_enable()


class SharedValueHead(nn.Module):
    """A value head on the policy's trunk; call with the policy's final hidden states."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.head = zero_head(hidden_size)

    def forward(self, hidden: torch.Tensor, response_len: int) -> torch.Tensor:
        return _response_values(hidden, self.head, response_len)
