"""Tiny models and tokenizers built in code, so tests never touch a hub or the network.

The test vocabulary is w0..w39 (ids 4-43) so tests can name tokens by index; the builders are
the library's own (ppo_core.lm.tiny), which also serve `tiny:` model sources.
"""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from ppo_core.lm import tiny

WORDS = [f"w{i}" for i in range(40)]
SPECIALS = tiny.SPECIALS


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: ids 0-3 specials (<pad>, <eos>, <bos>, <unk>), then w0..w39."""
    return tiny.tiny_tokenizer(WORDS, chat_template=None)


def tiny_llama(seed: int = 0, vocab_size: int = len(SPECIALS) + len(WORDS), hidden: int = 32, layers: int = 2) -> LlamaForCausalLM:
    """Seeds the global RNG like the tests expect (they draw their own samples after building)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny.tiny_llama_config(vocab_size, hidden, layers)).eval()
