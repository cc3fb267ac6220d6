"""Numeric precision: what `precision: auto` means on this machine, and bf16 training with fp32
master weights.

bf16 pays where the hardware multiplies bf16 natively: NVIDIA GPUs from Ampere on, and CPUs with
AMX or AVX512-BF16 (this project's 2-core Xeon: 2,370 GFLOP/s bf16 against 335 fp32 for a
2048x2048 matmul). Autocast casts fp32 weights to bf16 at every op call, which at PPO's small
row counts costs more than the matmul it speeds up on a CPU (an nn.Linear at 512 rows: 65
GFLOP/s under autocast, 580 with bf16 weights). So trained models hold bf16 weights for compute
and keep fp32 master copies for the optimizer (`MasterWeights`): gradients are accumulated into
the fp32 masters, AdamW steps them in fp32, and the bf16 weights are refreshed from them once
per step. Frozen models simply hold bf16 weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from ppo_core.lm import attention

Precision = Literal["auto", "fp32", "bf16"]
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@cache
def cpu_bf16_flags() -> tuple[str, ...]:
    """The native-bf16 instruction sets this CPU announces (Linux /proc/cpuinfo)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return ()
    return tuple(f for f in CPU_BF16_FLAGS if f in flags)


def resolve_precision(requested: Precision, device: torch.device) -> tuple[torch.dtype, str]:
    """(compute dtype, why): `auto` is bf16 where the device multiplies bf16 natively."""
    if requested == "fp32":
        return torch.float32, "precision: fp32 (as set)"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"precision: {requested}: bf16 on {torch.cuda.get_device_name(device)}"
        if requested == "bf16":
            raise ValueError(f"precision: bf16 requested but {torch.cuda.get_device_name(device)} has no bf16 support")
        return torch.float32, f"precision: auto: fp32 ({torch.cuda.get_device_name(device)} has no native bf16)"
    flags = cpu_bf16_flags()
    if requested == "bf16":
        return torch.bfloat16, "precision: bf16 (as set" + (f"; CPU has {', '.join(flags)})" if flags else "; this CPU emulates it: slow)")
    if flags:
        return torch.bfloat16, f"precision: auto: bf16 (CPU has {', '.join(flags)})"
    return torch.float32, "precision: auto: fp32 (this CPU has no native bf16 matmul)"


class MasterWeights:
    """fp32 master copies of a module's trainable parameters, whose own weights are bf16.

    Hand `master_params()` to the optimizer. After each backward call `accumulate_grads()` (the
    bf16 gradients are added to the masters' fp32 gradients and released), after the optimizer
    step `publish()` (the bf16 weights become the rounded masters: the one cast per step).
    With fp32 weights it is a pass-through: the masters are the parameters themselves.
    """

    def __init__(self, params: Iterable[nn.Parameter], masters: list[nn.Parameter] | None = None) -> None:
        """`masters`: the fp32 values of `params` where known exactly (default: widened from them)."""
        self.params = [p for p in params if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if not self.mixed:
            self.masters = self.params
        else:
            self.masters = masters or [nn.Parameter(p.detach().float().clone()) for p in self.params]

    @classmethod
    def cast(cls, module: nn.Module, dtype: torch.dtype) -> MasterWeights:
        """Take fp32 masters of `module`'s trainable weights (exact values, not the re-widened
        bf16 ones), then give the module `dtype` weights; for fp32 no copy is made."""
        masters = None
        if dtype != torch.float32:
            masters = [nn.Parameter(p.detach().float().clone()) for p in module.parameters() if p.requires_grad]
        module.to(dtype)
        return cls(module.parameters(), masters)

    def master_params(self) -> list[nn.Parameter]:
        return self.masters

    def grads_finite(self) -> bool:
        """Whether the trained weights' gradients (the bf16 ones before `accumulate_grads`) are
        all finite; with DTensor gradients (FSDP) every rank gets the same answer."""
        grads = [p.grad for p in self.params if p.grad is not None]
        return not grads or math.isfinite(float(torch.nn.utils.get_total_norm(grads)))

    def accumulate_grads(self) -> None:
        if not self.mixed:
            return
        for param, master in zip(self.params, self.masters, strict=True):
            if param.grad is None:
                continue
            grad = param.grad.float()
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            param.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        if not self.mixed:
            return
        for param, master in zip(self.params, self.masters, strict=True):
            param.copy_(master)

    def exact_state(self, state: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
        """`state` (a state dict of `module`, or part of one) with each trained weight replaced by
        its fp32 master: what a checkpoint must hold for a resumed run to continue exactly."""
        if not self.mixed:
            return state
        master_of = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        params = dict(module.named_parameters(remove_duplicate=False))
        return {k: master_of[id(params[k])].detach() if k in params and id(params[k]) in master_of else v
                for k, v in state.items()}

    def load_exact_state(self, state: dict[str, torch.Tensor], module: nn.Module) -> None:
        """Take back the masters from an `exact_state` (after the module loaded it) and publish them."""
        if not self.mixed:
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        with torch.no_grad():
            for name, param in module.named_parameters(remove_duplicate=False):
                if name in state and id(param) in index:
                    self.masters[index[id(param)]].copy_(state[name])
        self.publish()


def prefer_eager_attention(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Trained models on a CPU in bf16 use eager attention instead of sdpa: there torch's
    flash-attention backward costs ~10x its forward (a MiniLM reward-model step 0.35 -> 0.19 s,
    a SmolLM2 forward + backward over 16 x 75 tokens 2.54 -> 2.09 s). Same math: softmax(QK^T/sqrt(d)
    + mask) V either way. Llama-style decoders without attention dropout get ppo_core's eager
    attention (the same gradients, one copy of the probabilities saved instead of two:
    ppo_core.lm.attention), other models their own. Elsewhere (CUDA, fp32) the models keep what
    they were loaded with."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if hasattr(sub, "set_attn_implementation") and getattr(config, "_attn_implementation", None) == "sdpa":
            sub.set_attn_implementation(_eager_attention_for(config))


def _eager_attention_for(config) -> str:
    plain = config.model_type in attention.PLAIN_EAGER_MODEL_TYPES and not getattr(config, "attention_dropout", 0.0)
    return attention.register() if plain else "eager"
