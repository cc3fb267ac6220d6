"""The cache key of each stage for a given config and upstream results (one place, used by
the flow and by `rlhf stages`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from flows.caching import sha256_file, stage_key
from flows.config import PipelineConfig
from flows.refs import PolicyCheckpoint, PreferenceSet, ReferenceRef, RewardModelRef


def reference_key(cfg: PipelineConfig) -> str:
    return stage_key("snapshot_reference", {"reference": {"source": cfg.reference_source, "model": cfg.model}}, {})


def preferences_key(cfg: PipelineConfig, reference: ReferenceRef | None, labels_path: str | None = None) -> str:
    """Generated pairs depend on the reference policy; dataset and label-file pairs on their
    file's content; human labels on the label file the people filled."""
    generated = cfg.preferences.source.kind == "generated"
    if generated and reference is None:
        raise ValueError("generated preferences need the reference snapshot's hash")
    source = cfg.preferences.source
    data_file = labels_path or getattr(source, "path", None)
    return stage_key(
        "collect_preferences",
        {"preferences": cfg.preferences, "prompts": cfg.prompts},
        {"reference": reference.sha256 if generated and reference else None, "data": file_fingerprint(data_file)},
    )


def human_pairs_key(cfg: PipelineConfig, reference: ReferenceRef) -> str:
    return stage_key("collect_preferences", {"preferences": cfg.preferences, "prompts": cfg.prompts, "step": "pairs"},
                     {"reference": reference.sha256})


def file_fingerprint(path: str | None) -> str | None:
    """sha256 of a local data file (so an edited file reruns its stage); None for hub ids."""
    if path is None or not Path(path).is_file():
        return None
    return sha256_file(path)


def reward_key(cfg: PipelineConfig, prefs: PreferenceSet, reference: ReferenceRef) -> str:
    return stage_key(
        "train_reward_model",
        {"reward_model": cfg.reward_model, "gold": cfg.evaluation.gold_scorer}
        | ({"normalisation_sampling": cfg.ppo.sampling} if cfg.reward_model.normalise else {}),
        {"preferences": prefs.sha256, "reference": reference.sha256},
    )


def ppo_key(
    cfg: PipelineConfig,
    round_number: int,
    reference: ReferenceRef,
    reward: RewardModelRef,
    prefs: PreferenceSet,
    previous: PolicyCheckpoint | None,
) -> str:
    inputs = {
        "reference": reference.sha256,
        "reward_model": reward.sha256,
        "preferences": prefs.sha256,
        "previous": previous.sha256 if previous else None,
        "round": str(round_number),
    }
    return stage_key("ppo_round", {"ppo": cfg.ppo, "prompts": cfg.prompts, "model": cfg.model}, inputs)


def evaluate_key(
    cfg: PipelineConfig, policies: Sequence[PolicyCheckpoint], reference: ReferenceRef, reward: RewardModelRef
) -> str:
    inputs = {
        "policies": ",".join(p.sha256 for p in policies),
        "reference": reference.sha256,
        "reward_model": reward.sha256,
    }
    return stage_key("evaluate", {"evaluation": cfg.evaluation, "prompts": cfg.prompts}, inputs)
