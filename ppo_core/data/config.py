"""Typed settings of the data side of RLHF: prompts and preference collection.

Like `ppo_core.config`, every field has a docstring and every range is checked when the
model is built, so a bad YAML value fails before anything is loaded.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ppo_core.config import SamplingConfig, StrictModel


class PromptConfig(StrictModel):
    """Where the prompts come from and how they are shown to the policy."""

    source: str = "builtin:default"
    """A .txt file (one prompt per line), a .jsonl/.json/.csv/.parquet file, a local dataset
    folder, a hub dataset id, or `builtin:NAME` (ppo_core/data/NAME.jsonl, shipped with the
    library; `builtin:default` holds a few hundred short review/description requests)."""
    column: str = "prompt"
    """Column (or JSON key) holding the prompt text; ignored for .txt files and plain JSON lists
    of strings."""
    split: str = "train"
    """Dataset split, for hub ids and local dataset folders (single files have one split)."""
    heldout_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    """Share of prompts held out for evaluation, chosen by a hash of the prompt text so the same
    prompt is always on the same side."""
    use_chat_template: bool = True
    """Wrap each prompt as a user message in the tokenizer's chat template (with the assistant
    generation prompt) when the tokenizer has one; otherwise the raw text is tokenised."""
    system_prompt: str | None = None
    """Optional system message put before the user message in the chat template (or before the
    prompt text, separated by a blank line, when there is no template)."""
    max_prompts: int | None = Field(None, ge=1)
    """Keep only the first N distinct prompts (None keeps all)."""


class PreferenceColumns(StrictModel):
    """Which dataset columns hold each field of a preference row."""

    prompt: str | None = "prompt"
    """Prompt column; None (or a column the data lacks) for layouts where the prompt is the
    shared prefix of chosen and rejected (hh, conversational)."""
    chosen: str = "chosen"
    """Column of the preferred response (or whole dialogue, or message list)."""
    rejected: str = "rejected"
    """Column of the dispreferred response (or whole dialogue, or message list)."""
    margin: str | None = None
    """Optional numeric column: how much more chosen is preferred, subtracted inside the
    Bradley-Terry loss (Llama 2 style margin)."""


class DatasetPreferenceSource(StrictModel):
    """Preference pairs that already exist in a dataset."""

    kind: Literal["dataset"] = "dataset"
    """Discriminator."""
    path: str
    """Local .json/.jsonl/.csv/.parquet file, a local dataset folder, or a hub dataset id."""
    split: str = "train"
    """Split to read (hub ids and dataset folders; a single file is one split)."""
    columns: PreferenceColumns = Field(default_factory=PreferenceColumns)
    """Column mapping onto prompt/chosen/rejected/margin."""
    layout: Literal["auto", "explicit", "hh", "conversational"] = "auto"
    """explicit: prompt/chosen/rejected columns. hh: chosen and rejected are whole dialogues
    (Anthropic-HH "\\n\\nHuman: ... \\n\\nAssistant: ...") sharing a prefix, which becomes the
    prompt. conversational: message lists [{role, content}], rendered with the tokenizer's chat
    template. auto: conversational when chosen holds a list, explicit when the prompt column
    exists, else hh."""


class GeneratedPreferenceSource(StrictModel):
    """Pairs sampled from the reference policy and judged by a programmatic labeler."""

    kind: Literal["generated"] = "generated"
    """Discriminator."""
    responses_per_prompt: int = Field(2, ge=2)
    """k responses per prompt; every one of the k*(k-1)/2 pairs is labelled."""
    n_prompts: int | None = Field(None, ge=1)
    """Use only the first N training prompts (None: all)."""
    labeler: str = "vader"
    """Gold scorer: `vader` (sentiment compound of the response) or `module:function` taking
    (prompts, responses) and returning one float per response."""
    noise_temperature: float | None = Field(None, gt=0.0)
    """Bradley-Terry rater noise: a is preferred with probability sigmoid((s_a - s_b)/T).
    None labels deterministically by the gold score."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How the reference policy samples the candidate responses."""
    batch_size: int = Field(32, ge=1)
    """Sequences generated at once."""
    min_score_gap: float = Field(0.0, ge=0.0)
    """Drop pairs whose gold scores differ by less than this (near-ties carry no signal)."""
    truncations: int = Field(0, ge=0)
    """Also label this many word-boundary prefixes of each sampled response, paired with every
    other text of the prompt. A response against its own prefix shows the reward model which
    words moved the score: free labels from a programmatic labeler (measured in
    tests/bench/README.md). Used for training only, never for held-out evaluation."""


class LabelFileSource(StrictModel):
    """Pairs labelled by people: a JSONL written by `export_unlabeled` and filled in."""

    kind: Literal["label_file"] = "label_file"
    """Discriminator."""
    path: str
    """The filled JSONL: one pair per line with "preferred": "a" or "b"."""


class HumanPreferenceSource(StrictModel):
    """Pairs sampled from the reference policy and labelled by people in the Prefect UI: the
    pipeline pauses with one form per batch of pairs and continues with the submitted labels."""

    kind: Literal["human"] = "human"
    """Discriminator."""
    responses_per_prompt: int = Field(2, ge=2)
    """k responses per prompt; every pair is shown."""
    n_prompts: int | None = Field(None, ge=1)
    """Use only the first N training prompts (None: all)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How the reference policy samples the candidate responses."""
    batch_size: int = Field(32, ge=1)
    """Sequences generated at once."""
    pairs_per_form: int = Field(10, ge=1)
    """Pairs shown in one Prefect form."""
    timeout_seconds: int = Field(86400, ge=1)
    """How long the paused flow waits for each form before failing (the labels given so far are kept)."""


PreferenceSource = Annotated[
    DatasetPreferenceSource | GeneratedPreferenceSource | LabelFileSource | HumanPreferenceSource,
    Field(discriminator="kind"),
]


class PreferencesConfig(StrictModel):
    """How the preference set is collected and stored."""

    source: PreferenceSource = Field(default_factory=GeneratedPreferenceSource)
    """Where pairs come from: a dataset, generated and labelled, or an imported label file."""
    format: Literal["jsonl", "parquet"] = "jsonl"
    """File format of the collected set."""
    max_tokens: int = Field(512, ge=1)
    """Rows whose prompt plus longer response exceed this many tokens are bad rows."""
    max_bad_fraction: float = Field(0.1, ge=0.0, le=1.0)
    """Stop with an error when more than this share of the rows read is bad."""
    seed: int = 0
    """Seed for sampling and rater noise."""
