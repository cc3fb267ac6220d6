"""The three layouts preference datasets come in, reduced to (prompt, chosen, rejected) text.

- explicit: separate prompt/chosen/rejected string columns.
- hh (Anthropic-HH): chosen and rejected are whole dialogues "\\n\\nHuman: ...\\n\\nAssistant: ..."
  that share everything up to the final answer. The prompt is their longest common prefix cut
  just after its last "Assistant:" marker, so an answer that happens to start with the same
  words as the other one is not eaten into the prompt.
- conversational (TRL style): message lists [{role, content}]. With a prompt column the
  chosen/rejected lists hold the completion; without one the prompt is the shared leading
  messages. The prompt is rendered with the tokenizer's chat template (generation prompt
  included), the responses are the completion messages' contents.

A row that cannot be reduced raises `RowError` with a reason code, counted by the caller.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PreTrainedTokenizerBase

from ppo_core.data.config import PreferenceColumns

ASSISTANT_MARKER = "Assistant:"


class RowError(ValueError):
    """A row that is skipped; `reason` is the short code it is counted under."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def detect_layout(data: dict[str, Any], columns: PreferenceColumns) -> str:
    chosen = data.get(columns.chosen)
    if isinstance(chosen, list):
        return "conversational"
    if columns.prompt is not None and columns.prompt in data:
        return "explicit"
    return "hh"


def common_prefix_length(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def split_hh(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen answer, rejected answer) from two dialogues with a shared history."""
    prefix = chosen[: common_prefix_length(chosen, rejected)]
    marker = prefix.rfind(ASSISTANT_MARKER)
    if marker < 0:
        raise RowError("no_shared_prompt")
    cut = marker + len(ASSISTANT_MARKER)
    return chosen[:cut], chosen[cut:].strip(), rejected[cut:].strip()


def render_messages(
    messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase | None
) -> str:
    """A prompt conversation as the policy would see it, ending where the assistant answers.

    Without a tokenizer (or one with no chat template) a plain "role: content" rendering is
    used, so rows still load; the RM then learns on that rendering.
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    turns = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "assistant:"])


def _completion_text(messages: list[dict[str, Any]]) -> str:
    return "\n\n".join(str(m["content"]) for m in messages).strip()


def split_conversation(
    prompt: Any, chosen: Any, rejected: Any, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[str, str, str]:
    if not (is_messages(chosen) and is_messages(rejected)):
        raise RowError("wrong_type")
    if is_messages(prompt):
        prompt_messages = prompt
    elif isinstance(prompt, str) and prompt.strip():
        prompt_messages = [{"role": "user", "content": prompt}]
    else:  # implicit prompt: the leading messages both conversations share
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise RowError("no_shared_prompt")
        prompt_messages, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    return (
        render_messages(prompt_messages, tokenizer),
        _completion_text(chosen),
        _completion_text(rejected),
    )


def _text(data: dict[str, Any], column: str | None) -> str:
    value = data.get(column) if column is not None else None
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise RowError("missing_field")
    if not isinstance(value, str):
        raise RowError("wrong_type")
    return value


def parse_margin(data: dict[str, Any], column: str | None) -> float | None:
    if column is None:
        return None
    value = data.get(column)
    if value is None or value == "":
        return None
    try:
        margin = float(value)
    except (TypeError, ValueError):
        raise RowError("bad_margin") from None
    if not math.isfinite(margin):
        raise RowError("bad_margin")
    return margin


def to_triple(
    data: dict[str, Any],
    columns: PreferenceColumns,
    layout: str,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text of one row in the given (or detected) layout."""
    if layout == "auto":
        layout = detect_layout(data, columns)
    for column in (columns.chosen, columns.rejected):
        if data.get(column) is None:
            raise RowError("missing_field")
    if layout == "conversational":
        prompt = data.get(columns.prompt) if columns.prompt is not None else None
        return split_conversation(prompt, data[columns.chosen], data[columns.rejected], tokenizer)
    chosen, rejected = _text(data, columns.chosen), _text(data, columns.rejected)
    if layout == "hh":
        return split_hh(chosen, rejected)
    return _text(data, columns.prompt), chosen, rejected
