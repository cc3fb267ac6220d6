"""Cache keys of the stages: finished work is never redone, changed work always is.

key(stage) = sha256(stage name, stage version, the stage's own config section minus fields
that cannot change its result, the content hashes of its inputs). Prefect's default policy
hashes the task's source, which does not see the library code a task calls, so each stage
carries an explicit version here: bump it when the stage's semantics change.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from ppo_core.lm.checkpoint import sha256_file, sha256_tree

__all__ = ["STAGES", "key_from_parameters", "section_dict", "sha256_file", "sha256_tree", "stage_key"]

STAGE_VERSIONS = {  # in pipeline order: --force STAGE also refreshes every stage after it
    "snapshot_reference": "1",
    "collect_preferences": "1",
    "train_reward_model": "1",
    "ppo_round": "1",
    "evaluate": "1",
}
STAGES = tuple(STAGE_VERSIONS)

# Fields that only say where or how loudly something runs, never what it computes (ppo.launcher
# and ppo.ray: the same processes train exactly alike under every launcher).
NON_RESULT_FIELDS = {
    "device", "gradient_checkpointing", "checkpoint_every", "oom_halve_micro_batch", "n_samples_shown",
    "launcher", "ray",
}


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in sorted(value.items()) if k not in NON_RESULT_FIELDS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def section_dict(section: BaseModel | dict[str, Any] | None) -> Any:
    if isinstance(section, BaseModel):
        return _strip(section.model_dump(mode="json"))
    return _strip(section)


def stage_key(stage: str, sections: dict[str, Any], inputs: dict[str, str | None]) -> str:
    payload = {
        "stage": stage,
        "version": STAGE_VERSIONS[stage],
        "sections": {name: section_dict(s) for name, s in sorted(sections.items())},
        "inputs": dict(sorted(inputs.items())),
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
    return f"{stage}-{digest[:32]}"


def key_from_parameters(context: Any, parameters: dict[str, Any]) -> str:
    """Prefect cache_key_fn: the flow computes the key and passes it as the `key` parameter."""
    return parameters["key"]
