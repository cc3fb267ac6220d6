"""Tiny models and tokenizers built in code, so tests never touch a hub or the network."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(40)]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: ids 0-3 specials (<pad>, <eos>, <bos>, <unk>), then w0..w39."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tok.padding_side = "left"
    return tok


def tiny_llama(seed: int = 0, vocab_size: int = len(SPECIALS) + len(WORDS), hidden: int = 32, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()
