"""Stage: collect the preference set (dataset, generated + labelled, or imported labels).

Also fixes the prompt split for the whole run: training prompts (preferences, PPO) and
held-out prompts (evaluation only) are written next to the preference set.
"""

from __future__ import annotations

import time

import mlflow
from prefect import task

from flows.caching import key_from_parameters
from flows.refs import PreferenceSet, ReferenceRef
from flows.stages.common import logger, placement, stage_dir, write_prompt_file
from flows.tracking import TrackingContext, stage_run
from ppo_core.config import DeviceConfig
from ppo_core.data.config import PreferencesConfig, PromptConfig
from ppo_core.data.labelers import (
    import_labels,
    label_pairs,
    load_gold_scorer,
    sample_response_groups,
)
from ppo_core.data.preferences import PreferenceRow, load_preference_dataset, write_preference_set
from ppo_core.data.prompts import load_prompts, split_prompts
from ppo_core.lm.models import load_causal_lm, load_tokenizer


def _collect_rows(
    prefs: PreferencesConfig, prompt_cfg: PromptConfig, train: list[str], reference: ReferenceRef, labels: str | None,
    device: DeviceConfig,
) -> tuple[list[PreferenceRow], dict[str, int], list[str]]:
    source = prefs.source
    tokenizer = load_tokenizer(reference.path)
    if source.kind == "dataset":
        return load_preference_dataset(source, tokenizer, prefs.max_tokens, prefs.max_bad_fraction)
    if source.kind in ("label_file", "human"):
        path = source.path if source.kind == "label_file" else labels
        if path is None:
            raise ValueError("preferences.source: human labels were not collected (no label file)")
        return import_labels(path), {}, []
    policy = placement(device).freeze(load_causal_lm(reference.path))
    prompts = train[: source.n_prompts] if source.n_prompts else train
    groups = sample_response_groups(
        policy, tokenizer, prompts, prompt_cfg, source.responses_per_prompt, source.sampling,
        source.batch_size, prefs.seed,
    )
    scorer = load_gold_scorer(source.labeler)
    rows = label_pairs(
        groups, scorer, source.noise_temperature, prefs.seed, source.min_score_gap, source.truncations
    )
    return rows, {}, []


@task(name="collect_preferences", cache_key_fn=key_from_parameters, persist_result=True)
def collect_preferences(
    key: str,
    preferences: PreferencesConfig,
    prompts: PromptConfig,
    device: DeviceConfig,
    reference: ReferenceRef,
    work_dir: str,
    tracking: TrackingContext,
    labels_path: str | None = None,
) -> PreferenceSet:
    start = time.perf_counter()
    log = logger()
    folder = stage_dir(work_dir, "collect_preferences", key)
    train, heldout = split_prompts(load_prompts(prompts), prompts.heldout_fraction)
    if not train or not heldout:
        raise ValueError(
            f"prompts: {len(train)} training and {len(heldout)} held-out prompts from {prompts.source!r}; "
            "both must be non-empty (add prompts or change prompts.heldout_fraction)"
        )
    log.info("prompts: %d train, %d held-out", len(train), len(heldout))
    rows, rejected, examples = _collect_rows(preferences, prompts, train, reference, labels_path, device)
    info = write_preference_set(rows, folder / f"preferences.{preferences.format}", preferences.format, rejected, examples)
    result = PreferenceSet(
        path=info.path, sha256=info.sha256, n_rows=info.n_rows, n_read=info.n_read,
        rejected=info.rejected, rejected_examples=info.rejected_examples,
        train_prompts_path=str(write_prompt_file(folder / "train_prompts.json", train)),
        heldout_prompts_path=str(write_prompt_file(folder / "heldout_prompts.json", heldout)),
    )
    with stage_run(tracking, "collect_preferences", {"rlhf.sha256": info.sha256}) as run_id:
        result.mlflow_run_id = run_id
        result.seconds = time.perf_counter() - start
        dataset = mlflow.data.from_pandas(
            _frame(rows), source=info.path, name=f"{tracking.pipeline}-preferences", digest=info.sha256[:16]
        )
        mlflow.log_input(dataset, context="training")
        mlflow.log_metrics({"n_rows": info.n_rows, "n_read": info.n_read, "seconds": result.seconds,
                            **{f"rejected/{k}": v for k, v in info.rejected.items()}})
        mlflow.log_dict(info.model_dump(mode="json"), "preference_set.json")
    log.info("preference set: %d pairs (%d read, rejected %s) in %.1fs", info.n_rows, info.n_read, info.rejected, result.seconds)
    return result


def _frame(rows: list[PreferenceRow]):
    import pandas as pd

    return pd.DataFrame([{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected} for r in rows])
