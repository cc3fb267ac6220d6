"""Tiny random models for smoke runs and tests, built in code (no hub, no download).

`tiny:llama` in any model source resolves here: a 2-layer Llama over a word-level English
vocabulary that includes sentiment words, so the VADER gold scorer has something to judge
even on random weights. The folder is materialised once under $RLHF_TINY_DIR (default
~/.cache/rlhf-tiny) and is byte-identical for the same name.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
WORDS = (
    ["the", "a", "it", "was", "is", "and", "but", "very", "so", "food", "movie", "hotel", "day", "trip", "service", "room", "staff", "view", "music", "good", "great", "lovely", "happy", "wonderful", "excellent", "nice", "fun", "best", "enjoyed", "love", "bad", "awful", "terrible", "sad", "boring", "worst", "hate", "poor", "dirty", "rude", "slow", "okay", "fine", "average", "normal", "quiet", "busy", "long", "short", "new", "old", "today", "yesterday", "we", "i", "they"]
)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)
TINY_NAMES = ("llama",)


def tiny_tokenizer(words: list[str] | None = None, chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ids 0-3 are <pad>, <eos>, <bos>, <unk>, then `words` in order."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + (WORDS if words is None else words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tok.padding_side = "left"
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def tiny_llama_config(vocab_size: int = len(SPECIALS) + len(WORDS), hidden: int = 32, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )


def tiny_llama(
    seed: int = 0, vocab_size: int = len(SPECIALS) + len(WORDS), hidden: int = 32, layers: int = 2
) -> LlamaForCausalLM:
    """Random weights fixed by `seed`; the caller's RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_llama_config(vocab_size, hidden, layers))


def tiny_dir() -> Path:
    return Path(os.environ.get("RLHF_TINY_DIR", Path.home() / ".cache" / "rlhf-tiny"))


def materialise(name: str) -> Path:
    """The folder of tiny model `name`, written on first use (atomically)."""
    if name not in TINY_NAMES:
        raise ValueError(f"tiny:{name}: unknown tiny model; known: {', '.join(TINY_NAMES)}")
    folder = tiny_dir() / name
    if (folder / "config.json").exists():
        return folder
    tmp = folder.with_name(f".{name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tiny_llama().save_pretrained(tmp)
    tiny_tokenizer().save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process won the race; its folder is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder
