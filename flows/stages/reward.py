"""Stage: train the reward model r_phi on the preference set, normalise it, register it."""

from __future__ import annotations

import time

import mlflow
from prefect import task

from flows.caching import key_from_parameters, sha256_tree
from flows.refs import PreferenceSet, ReferenceRef, RewardModelRef
from flows.registration import lineage_tags
from flows.registry import register_model
from flows.stages.common import logger, placement, read_prompt_file, stage_dir
from flows.tracking import MetricLogger, TrackingContext, stage_run
from ppo_core.config import DeviceConfig, SamplingConfig
from ppo_core.data.config import PromptConfig
from ppo_core.data.labelers import load_gold_scorer, sample_response_groups
from ppo_core.data.preferences import read_preference_set
from ppo_core.lm.folders import replace_folder, temp_folder_for
from ppo_core.lm.models import load_causal_lm, load_tokenizer
from ppo_core.lm.placement import Placement
from ppo_core.reward.config import RewardModelConfig
from ppo_core.reward.training import fit_normalisation, split_reward_rows
from ppo_core.reward.training import train_reward_model as train_rm

NORMALISATION_PROMPTS = 64


def _reference_samples(
    reference: ReferenceRef, prompts: list[str], prompt_cfg: PromptConfig, sampling: SamplingConfig, where: Placement,
    seed: int,
) -> tuple[list[str], list[str]]:
    """Reference-policy responses to training prompts, sampled as PPO samples (`ppo.sampling`):
    what normalisation is fitted on (lm-human-preferences), so the PPO policy starts at reward
    mean 0, std 1 on the distribution the RM will score."""
    tokenizer = load_tokenizer(reference.path)
    policy = where.freeze(load_causal_lm(reference.path))
    groups = sample_response_groups(policy, tokenizer, prompts, prompt_cfg, 1, sampling, 32, seed)
    return [p for p, _ in groups], [rs[0] for _, rs in groups]


@task(name="train_reward_model", cache_key_fn=key_from_parameters, persist_result=True)
def train_reward_model(
    key: str,
    reward_model: RewardModelConfig,
    prompts: PromptConfig,
    gold_scorer: str | None,
    sampling: SamplingConfig,
    device: DeviceConfig,
    prefs: PreferenceSet,
    reference: ReferenceRef,
    work_dir: str,
    tracking: TrackingContext,
) -> RewardModelRef:
    start = time.perf_counter()
    cfg = reward_model
    rows = read_preference_set(prefs.path)
    train_rows, eval_rows = split_reward_rows(rows)
    gold = load_gold_scorer(gold_scorer) if gold_scorer else None
    final = stage_dir(work_dir, "train_reward_model", key) / "model"
    with stage_run(tracking, "train_reward_model") as run_id:
        where = placement(DeviceConfig(device=cfg.device, precision=device.precision) if cfg.device else device)
        rm, report = train_rm(
            cfg, train_rows, eval_rows, on_metrics=MetricLogger(run_id, tracking.uri), gold_scorer=gold, placement=where,
            show_progress=True,
        )
        if cfg.normalise:
            texts = read_prompt_file(prefs.train_prompts_path)[:NORMALISATION_PROMPTS]
            fit_normalisation(rm, *_reference_samples(reference, texts, prompts, sampling, where, cfg.seed))
        tmp = temp_folder_for(final)
        rm.save_pretrained(tmp)
        replace_folder(tmp, final)
        sha = sha256_tree(final)
        result = RewardModelRef(
            path=str(final), sha256=sha, eval_accuracy=report.eval_accuracy, gold_agreement=report.gold_agreement,
            norm_gain=rm.gain, norm_bias=rm.bias, mlflow_run_id=run_id,
        )
        mlflow.log_params({"backbone": cfg.backbone, "n_train": len(train_rows), "n_eval": len(eval_rows)})
        metrics = report.model_dump(exclude={"gain", "bias"})  # those of the fit above
        mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, int | float) and v is not None}
                           | {"gain": rm.gain, "bias": rm.bias})
        if tracking.register_models:
            name = f"{tracking.pipeline}-reward-model"
            tags = lineage_tags(tracking, preference_sha256=prefs.sha256, reference_version=reference.version)
            result.model_uri, result.version = register_model(
                tracking.uri, name, rm.model, rm.tokenizer, "text-classification", sha, tags
            )
            result.registered_name = name
        result.seconds = time.perf_counter() - start
    logger().info("reward model: held-out accuracy %s, gold agreement %s, %.1fs",
                  report.eval_accuracy, report.gold_agreement, result.seconds)
    return result
