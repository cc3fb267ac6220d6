"""Stage: one PPO round (k = 1..R), checkpointed inside itself.

A round continues the trainer state of round k-1 (policy, critic, optimisers, RNG, KL
controller, iteration counter), so R cached rounds equal one uninterrupted run. Inside the
round the trainer checkpoints atomically every `checkpoint_every` iterations into a folder
named by the round's cache key: a crash resumes from the last in-round checkpoint.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import mlflow
import torch
from prefect import task
from prefect.artifacts import create_table_artifact
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.caching import key_from_parameters, sha256_tree
from flows.faults import maybe_fail
from flows.refs import PolicyCheckpoint, PreferenceSet, ReferenceRef, RewardModelRef
from flows.registry import register_model
from flows.stages.common import fresh_tmp, logger, publish, read_prompt_file, stage_dir
from flows.tracking import MetricLogger, TrackingContext, stage_run
from ppo_core.checkpoint import latest_checkpoint
from ppo_core.config import DeviceConfig
from ppo_core.plots import plot_training_curves
from ppo_core.prompts import encode_prompts
from ppo_core.reward_model import RewardModel, RewardScorer
from ppo_core.trainer import PPOTrainer
from ppo_core.value import CriticModel


def build_trainer(
    settings: dict, reference: ReferenceRef, reward: RewardModelRef, prefs: PreferenceSet, device: DeviceConfig, on_metrics
) -> PPOTrainer:
    """Models and data for PPO, all from the stage references (never from the raw config)."""
    from flows.config import PipelineConfig  # late: only the sections are needed here

    cfg = PipelineConfig.model_validate(settings)
    tokenizer = AutoTokenizer.from_pretrained(reference.path)
    policy = AutoModelForCausalLM.from_pretrained(reference.path, dtype=torch.float32)
    ref_model = None
    if cfg.ppo.lora:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(task_type="CAUSAL_LM", **cfg.ppo.lora))
    else:
        ref_model = AutoModelForCausalLM.from_pretrained(reference.path, dtype=torch.float32)
    critic = None
    if cfg.ppo.algo.critic == "separate":
        critic = (
            CriticModel.from_pretrained(reward.path)
            if cfg.ppo.critic_init == "reward_model"
            else CriticModel.from_model(policy)
        )
    rm = RewardModel.from_pretrained(reward.path)
    texts = read_prompt_file(prefs.train_prompts_path)
    scorer = RewardScorer(rm, tokenizer, texts)
    prompt_ids = encode_prompts(tokenizer, texts, cfg.prompts)
    return PPOTrainer(
        cfg.ppo.algo, cfg.ppo.sampling, policy, ref_model, critic, tokenizer, scorer, prompt_ids,
        device=device, on_metrics=on_metrics,
    )


def _export_policy(trainer: PPOTrainer, folder: Path) -> tuple[str, torch.nn.Module]:
    """Write the policy as a plain HF folder; return its hash and the plain model (LoRA merged)."""
    tmp = fresh_tmp(folder)
    policy = trainer.policy
    if hasattr(policy, "merge_and_unload"):
        policy = policy.merge_and_unload()  # a plain model: consumers need no peft
    policy.save_pretrained(tmp)
    trainer.tokenizer.save_pretrained(tmp)
    publish(tmp, folder)
    return sha256_tree(folder), policy


def _run_round(trainer: PPOTrainer, round_number: int, per_round: int, every: int, state_dir: Path) -> None:
    start_iteration = (round_number - 1) * per_round
    target = round_number * per_round
    if trainer.iteration < start_iteration:
        raise RuntimeError(f"round {round_number}: trainer at iteration {trainer.iteration}, expected {start_iteration}")
    progress = tqdm(total=target - start_iteration, initial=trainer.iteration - start_iteration, desc=f"PPO round {round_number}", unit="it")
    while trainer.iteration < target:
        metrics = trainer.step()
        progress.update(1)
        progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.2f}")
        local = trainer.iteration - start_iteration
        if local % every == 0 or trainer.iteration == target:
            trainer.save(state_dir)
        maybe_fail("ppo_round", round_number, local)
    progress.close()


def _log_samples(trainer: PPOTrainer, round_number: int, run_id: str | None) -> None:
    rows = trainer.sample_table(n=8)
    if not rows:
        return
    if run_id is not None:
        mlflow.log_table({k: [r[k] for r in rows] for k in rows[0]}, artifact_file=f"samples/round-{round_number}.json")
    create_table_artifact(table=rows, key=f"ppo-samples-round-{round_number}", description=f"PPO round {round_number}: sampled responses and scores")


@task(name="ppo_round", tags=["gpu"], cache_key_fn=key_from_parameters, persist_result=True)
def ppo_round(
    key: str,
    round_number: int,
    settings: dict,
    reference: ReferenceRef,
    reward: RewardModelRef,
    prefs: PreferenceSet,
    previous: PolicyCheckpoint | None,
    work_dir: str,
    tracking: TrackingContext,
    is_last: bool,
    restart: bool = False,
) -> PolicyCheckpoint:
    start = time.perf_counter()
    log = logger()
    settings = copy.deepcopy(settings)
    ppo = settings["ppo"]
    per_round, every = ppo["iterations_per_round"], ppo["checkpoint_every"]
    device = DeviceConfig.model_validate(settings["orchestration"]["device"])
    folder = stage_dir(work_dir, "ppo_round", key)
    state_dir = folder / "state"
    if restart and state_dir.exists():
        # --force: the in-round checkpoints of an earlier run of this key would be "resumed",
        # finished ones included, and the round would recompute nothing.
        shutil.rmtree(state_dir)
    on_gpu = torch.cuda.is_available() and device.device != "cpu"
    with stage_run(tracking, f"ppo_round_{round_number}", {"rlhf.round": str(round_number)}, on_gpu) as run_id:
        metric_logger = MetricLogger(run_id, tracking.uri)
        micro = ppo["algo"].get("micro_batch_size")
        while True:
            settings["ppo"]["algo"]["micro_batch_size"] = micro
            trainer = build_trainer(settings, reference, reward, prefs, device, metric_logger)
            resumed = latest_checkpoint(state_dir)
            if resumed is not None:
                trainer.load(resumed)
                log.info("round %d: resuming from in-round checkpoint %s", round_number, resumed.name)
            elif previous is not None:
                trainer.load(previous.state_path)
            try:
                _run_round(trainer, round_number, per_round, every, state_dir)
                break
            except torch.cuda.OutOfMemoryError:
                mini = ppo["algo"]["batch_size"] // ppo["algo"]["num_mini_batches"]
                current = micro or mini
                if not ppo["oom_halve_micro_batch"] or current <= 1:
                    raise
                micro = current // 2
                log.warning("round %d: CUDA out of memory; retrying with micro_batch_size=%d", round_number, micro)
                del trainer
                torch.cuda.empty_cache()
        sha, plain_policy = _export_policy(trainer, folder / "policy")
        history = metric_logger.history
        # Empty when the round resumed from its own final checkpoint (a crash after the last
        # iteration): nothing new to plot.
        plot = plot_training_curves(history, folder / "curves.png") if history else None
        (folder / "history.json").write_text(json.dumps(history))
        result = PolicyCheckpoint(
            path=str(folder / "policy"),
            sha256=sha,
            round=round_number,
            iteration=trainer.iteration,
            state_path=str(latest_checkpoint(state_dir)),
            metrics={k: v for k, v in (history[-1] if history else {}).items() if isinstance(v, float)},
            mlflow_run_id=run_id,
        )
        if run_id is not None:
            if plot is not None:
                mlflow.log_artifact(str(plot), artifact_path="plots")
            _log_samples(trainer, round_number, run_id)
            if is_last and settings["tracking"]["register_models"]:
                name = f"{tracking.pipeline}-policy"
                lineage = {
                    "rlhf.config_hash": tracking.config_hash,
                    "rlhf.preference_sha256": prefs.sha256,
                    "rlhf.reward_model_version": str(reward.version),
                    "rlhf.reference_version": str(reference.version),
                    "rlhf.round": str(round_number),
                    "prefect.flow_run_id": tracking.flow_run_id,
                }
                result.model_uri, result.version = register_model(
                    tracking.uri, name, plain_policy, trainer.tokenizer, "text-generation", sha, lineage, aliases=("candidate",)
                )
                result.registered_name = name
        result.seconds = time.perf_counter() - start
    log.info("round %d done: iteration %d, policy sha256 %s, %.1fs", round_number, trainer.iteration, sha[:12], result.seconds)
    return result
