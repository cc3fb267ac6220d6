"""Prompts: loading them, splitting them into train/held-out, and turning them into tokens.

The split is decided per prompt by a hash of its text, not by its position in a list, so
adding, removing or reordering other prompts never moves a prompt across the line: held-out
evaluation stays held out across runs and dataset versions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from ppo_core.data.config import PromptConfig
from ppo_core.data.records import read_records

BUILTIN = "builtin:"
BUILTIN_FILES = {"default": "prompts.jsonl"}
"""builtin:NAME -> a file in ppo_core/data (package data); other names map to NAME.jsonl."""


def builtin_path(name: str) -> Path:
    """A prompt set shipped with the library (ppo_core/data, so no other package is needed)."""
    filename = BUILTIN_FILES.get(name, f"{name}.jsonl")
    path = Path(str(resources.files("ppo_core") / "data" / filename))
    if not path.is_file():
        raise FileNotFoundError(f"{BUILTIN}{name}: no built-in prompt set {path.name}")
    return path


def load_prompts(cfg: PromptConfig) -> list[str]:
    """Distinct, non-empty prompt strings in file order (first `max_prompts` of them)."""
    source = cfg.source
    if source.startswith(BUILTIN):
        source = str(builtin_path(source[len(BUILTIN) :]))
    prompts: list[str] = []
    seen: set[str] = set()
    for record in read_records(source, cfg.split, text_column=cfg.column):
        if record.data is None:
            continue  # unreadable line: a prompt we cannot show anyway
        value = record.data.get(cfg.column, record.data.get("text"))
        if not isinstance(value, str) or not value.strip() or value in seen:
            continue
        seen.add(value)
        prompts.append(value)
        if cfg.max_prompts is not None and len(prompts) >= cfg.max_prompts:
            break
    if not prompts:
        raise ValueError(f"{cfg.source}: no prompts found in column {cfg.column!r}")
    return prompts


def hash_unit(text: str, salt: str = "") -> float:
    """A uniform number in [0, 1) fixed by the text: the first 8 bytes of sha256(salt NUL text)."""
    digest = hashlib.sha256(f"{salt}\0{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_prompts(
    prompts: list[str], heldout_fraction: float, salt: str = ""
) -> tuple[list[str], list[str]]:
    """(train, held_out): a prompt is held out iff hash_unit(prompt) < heldout_fraction."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    train, heldout = [], []
    for prompt in prompts:
        (heldout if hash_unit(prompt, salt) < heldout_fraction else train).append(prompt)
    return train, heldout


def reward_eval_prompts(prompts: Iterable[str]) -> set[str]:
    """The prompts whose preference pairs evaluate the reward model: a second hash split with
    its own salt, so no prompt has pairs on both sides and a prompt's side never changes."""
    _, held_out = split_prompts(sorted(set(prompts)), 0.2, salt="reward-model-eval")
    return set(held_out)


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, cfg: PromptConfig) -> str:
    """The text the policy is conditioned on (chat-templated when configured and available)."""
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        if cfg.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if cfg.system_prompt is not None:
        return f"{cfg.system_prompt}\n\n{prompt}"
    return prompt


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], cfg: PromptConfig
) -> list[list[int]]:
    """Token ids per prompt. A rendered chat template already holds its special tokens (BOS,
    role markers), so it is tokenised without adding them a second time."""
    templated = cfg.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    out = []
    for prompt in prompts:
        text = render_prompt(tokenizer, prompt, cfg)
        out.append(tokenizer(text, add_special_tokens=not templated)["input_ids"])
    return out
