"""`rlhf stages`: the cache key of every stage and whether its result is already stored.

Keys chain: a stage's key needs the content hashes of its inputs, which live in the upstream
stages' stored results; past the first stage without a stored result, keys are unknown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.results import ResultStore

from flows import keys
from flows.config import PipelineConfig
from flows.records import RECORD_SERIALIZER, RecordStorage


def _reader(work_dir: Path):
    store = ResultStore(result_storage=RecordStorage(basepath=str(work_dir / "results")), serializer=RECORD_SERIALIZER)

    def read(key: str) -> Any | None:
        if not store.exists(key):
            return None
        return store.read(key).result

    return read


def stage_table(cfg: PipelineConfig) -> list[dict[str, str]]:
    work_dir = (Path(cfg.orchestration.work_dir) / cfg.name).resolve()
    read = _reader(work_dir)
    rows: list[dict[str, str]] = []

    def add(stage: str, key: str | None) -> Any | None:
        result = read(key) if key else None
        rows.append({"stage": stage, "key": key or "(needs upstream results)", "status": "cached" if result else "missing"})
        return result

    ref = add("snapshot_reference", keys.reference_key(cfg))
    generated = cfg.preferences.source.kind == "generated"
    labels = None
    if cfg.preferences.source.kind == "human" and ref is not None:
        folder = work_dir / "stages" / "sample_pairs_for_labelling" / keys.human_pairs_key(cfg, ref)
        labels = str(folder / "labels.jsonl") if (folder / "labels.jsonl").exists() else None
    prefs = add("collect_preferences", keys.preferences_key(cfg, ref, labels) if ref or not generated else None)
    rm = add("train_reward_model", keys.reward_key(cfg, prefs, ref) if prefs and ref else None)
    previous, policies = None, []
    for k in range(1, cfg.ppo.rounds + 1):
        ready = rm is not None and (k == 1 or previous is not None)
        previous = add(f"ppo_round_{k}", keys.ppo_key(cfg, k, ref, rm, prefs, previous) if ready else None)
        policies.append(previous)
    done = all(p is not None for p in policies)
    add("evaluate", keys.evaluate_key(cfg, policies, ref, rm) if done else None)
    return rows
