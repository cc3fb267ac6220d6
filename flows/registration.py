"""Registering a PPO round's policy in the MLflow Model Registry, with its lineage.

The last round registers its policy as `candidate`; evaluation registers an earlier round too
when the gates promote that one (GateConfig.promote = best_round).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.refs import PolicyCheckpoint, PreferenceSet, ReferenceRef, RewardModelRef
from flows.registry import register_model
from flows.tracking import TrackingContext


def register_policy(
    result: PolicyCheckpoint,
    tracking: TrackingContext,
    prefs: PreferenceSet,
    reward: RewardModelRef,
    reference: ReferenceRef,
    aliases: tuple[str, ...] = ("candidate",),
) -> None:
    """Log the round's exported policy as a new version of `<pipeline>-policy` and record its
    name, version and URI on `result`."""
    name = f"{tracking.pipeline}-policy"
    lineage = {
        "rlhf.config_hash": tracking.config_hash,
        "rlhf.preference_sha256": prefs.sha256,
        "rlhf.reward_model_version": str(reward.version),
        "rlhf.reference_version": str(reference.version),
        "rlhf.round": str(result.round),
        "prefect.flow_run_id": tracking.flow_run_id,
    }
    policy = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(result.path)
    result.model_uri, result.version = register_model(
        tracking.uri, name, policy, tokenizer, "text-generation", result.sha256, lineage, aliases=aliases
    )
    result.registered_name = name
