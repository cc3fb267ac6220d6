"""Stage: train the reward model r_phi on the preference set, normalise it, register it."""

from __future__ import annotations

import time

import mlflow
import torch
from prefect import task
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.caching import key_from_parameters, sha256_tree
from flows.refs import PreferenceSet, ReferenceRef, RewardModelRef
from flows.registry import register_model
from flows.stages.common import fresh_tmp, logger, publish, read_prompt_file, stage_dir
from flows.tracking import MetricLogger, TrackingContext, stage_run
from ppo_core.data.config import PromptConfig
from ppo_core.data.labelers import load_gold_scorer, sample_response_groups
from ppo_core.data.preferences import read_preference_set
from ppo_core.reward.config import RewardModelConfig
from ppo_core.reward.training import fit_normalisation, split_reward_rows
from ppo_core.reward.training import train_reward_model as train_rm

NORMALISATION_PROMPTS = 64


def _reference_samples(reference: ReferenceRef, prompts: list[str], prompt_cfg: PromptConfig, seed: int) -> tuple[list[str], list[str]]:
    """Reference-policy responses to training prompts: what normalisation is fitted on
    (lm-human-preferences), so the PPO policy starts at reward mean 0, std 1."""
    tokenizer = AutoTokenizer.from_pretrained(reference.path)
    policy = AutoModelForCausalLM.from_pretrained(reference.path, dtype=torch.float32)
    from ppo_core.config import SamplingConfig

    groups = sample_response_groups(policy, tokenizer, prompts, prompt_cfg, 1, SamplingConfig(), 32, seed)
    return [p for p, _ in groups], [rs[0] for _, rs in groups]


@task(name="train_reward_model", cache_key_fn=key_from_parameters, persist_result=True)
def train_reward_model(
    key: str, settings: dict, prefs: PreferenceSet, reference: ReferenceRef, work_dir: str, tracking: TrackingContext
) -> RewardModelRef:
    start = time.perf_counter()
    log = logger()
    cfg = RewardModelConfig.model_validate(settings["reward_model"])
    prompt_cfg = PromptConfig.model_validate(settings["prompts"])
    rows = read_preference_set(prefs.path)
    train_rows, eval_rows = split_reward_rows(rows)
    gold_name = settings["evaluation"].get("gold_scorer")
    gold = load_gold_scorer(gold_name) if gold_name else None
    final = stage_dir(work_dir, "train_reward_model", key) / "model"
    with stage_run(tracking, "train_reward_model") as run_id:
        metric_logger = MetricLogger(run_id, tracking.uri)
        # normalisation is fitted below, on fresh reference samples, not on the training pairs
        rm, report = train_rm(cfg.model_copy(update={"normalise": False}), train_rows, eval_rows,
                              on_metrics=metric_logger, gold_scorer=gold)
        if cfg.normalise:
            prompts = read_prompt_file(prefs.train_prompts_path)[:NORMALISATION_PROMPTS]
            p, r = _reference_samples(reference, prompts, prompt_cfg, cfg.seed)
            fit_normalisation(rm, p, r)
        tmp = fresh_tmp(final)
        rm.save_pretrained(tmp)
        publish(tmp, final)
        sha = sha256_tree(final)
        result = RewardModelRef(
            path=str(final), sha256=sha, eval_accuracy=report.eval_accuracy, gold_agreement=report.gold_agreement,
            norm_gain=rm.gain, norm_bias=rm.bias, mlflow_run_id=run_id,
        )
        if run_id is not None:
            mlflow.log_params({"backbone": cfg.backbone, "n_train": len(train_rows), "n_eval": len(eval_rows)})
            metrics = report.model_dump(exclude={"gain", "bias"})  # those of the fit below
            mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, int | float) and v is not None}
                               | {"gain": rm.gain, "bias": rm.bias})
            if settings["tracking"]["register_models"]:
                name = f"{tracking.pipeline}-reward-model"
                lineage = {"rlhf.config_hash": tracking.config_hash, "rlhf.preference_sha256": prefs.sha256,
                           "rlhf.reference_version": str(reference.version), "prefect.flow_run_id": tracking.flow_run_id}
                result.model_uri, result.version = register_model(
                    tracking.uri, name, rm.model, rm.tokenizer, "text-classification", sha, lineage
                )
                result.registered_name = name
        result.seconds = time.perf_counter() - start
    log.info("reward model: held-out accuracy %s, gold agreement %s, %.1fs",
             report.eval_accuracy, report.gold_agreement, result.seconds)
    return result
