"""Registering the pipeline's models in the MLflow Model Registry, with their lineage.

Every registered version carries the same lineage tags: the config hash and Prefect flow run
that made it, plus its parents (preference set, reference and reward-model versions, round).
The last PPO round registers its policy as `candidate`; evaluation registers an earlier round
too when the gates promote that one (GateConfig.promote = best_round).
"""

from __future__ import annotations

from flows.refs import PolicyCheckpoint, PreferenceSet, ReferenceRef, RewardModelRef
from flows.registry import register_model
from flows.tracking import TrackingContext
from ppo_core.lm.models import load_causal_lm, load_tokenizer


def lineage_tags(tracking: TrackingContext, **parents: object) -> dict[str, str]:
    """{"rlhf.config_hash", "prefect.flow_run_id"} plus one `rlhf.<name>` tag per parent."""
    return {
        "rlhf.config_hash": tracking.config_hash,
        "prefect.flow_run_id": tracking.flow_run_id,
        **{f"rlhf.{name}": str(value) for name, value in parents.items()},
    }


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
    tags = lineage_tags(
        tracking, preference_sha256=prefs.sha256, reward_model_version=reward.version,
        reference_version=reference.version, round=result.round,
    )
    policy, tokenizer = load_causal_lm(result.path), load_tokenizer(result.path)
    result.model_uri, result.version = register_model(
        tracking.uri, name, policy, tokenizer, "text-generation", result.sha256, tags, aliases=aliases
    )
    result.registered_name = name
