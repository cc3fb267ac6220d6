"""Stage: one PPO round (k = 1..R), checkpointed inside itself.

A round continues the trainer state of round k-1 (policy, critic, optimisers, RNG, KL
controller, iteration counter), so R cached rounds equal one uninterrupted run. Inside the
round the trainer checkpoints atomically every `checkpoint_every` iterations into a folder
named by the round's cache key: a crash resumes from the last in-round checkpoint. Where the
round's processes run is `ppo.launcher` (flows.launchers): this process, torchrun processes on
this host, or Ray Train workers across machines (flows.ray_launcher).
"""

from __future__ import annotations

import shutil
import time

import mlflow
import torch
from prefect import task
from prefect.artifacts import create_table_artifact

from flows.caching import key_from_parameters, sha256_tree
from flows.config import PPOStageConfig
from flows.launchers import launch_round
from flows.refs import PolicyCheckpoint, PreferenceSet, ReferenceRef, RewardModelRef
from flows.registration import register_policy
from flows.stages.common import logger, stage_dir
from flows.tracking import TrackingContext, stage_run
from flows.workers import ADAPTER, RoundJob
from ppo_core.config import DeviceConfig
from ppo_core.data.config import PromptConfig
from ppo_core.eval.plots import plot_training_curves
from ppo_core.lm.checkpoint import latest_checkpoint


def _log_samples(rows: list[dict], round_number: int) -> None:
    if not rows:
        return
    mlflow.log_table({k: [r[k] for r in rows] for k in rows[0]}, artifact_file=f"samples/round-{round_number}.json")
    create_table_artifact(table=rows, key=f"ppo-samples-round-{round_number}", description=f"PPO round {round_number}: sampled responses and scores")


@task(name="ppo_round", tags=["gpu"], cache_key_fn=key_from_parameters, persist_result=True)
def ppo_round(
    key: str,
    round_number: int,
    ppo: PPOStageConfig,
    prompts: PromptConfig,
    device: DeviceConfig,
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
    folder = stage_dir(work_dir, "ppo_round", key)
    job = RoundJob(
        ppo=ppo, prompts=prompts, device=device, reference=reference, reward=reward, prefs=prefs,
        round_number=round_number, folder=str(folder),
        previous_state=previous.state_path if previous is not None else None, tracking_uri=tracking.uri,
    )
    if restart and job.state_dir.exists():
        # --force: the in-round checkpoints of an earlier run of this key would be "resumed",
        # finished ones included, and the round would recompute nothing.
        shutil.rmtree(job.state_dir)
    on_gpu = torch.cuda.is_available() and device.device != "cpu"
    with stage_run(tracking, f"ppo_round_{round_number}", {"rlhf.round": str(round_number)}, on_gpu) as run_id:
        job.run_id = run_id
        out = launch_round(job)
        # no history when the round resumed from its own final checkpoint: nothing new to plot
        plot = plot_training_curves(out.history, folder / "curves.png") if out.history else None
        result = PolicyCheckpoint(
            path=str(folder / "policy"),
            sha256=sha256_tree(folder / "policy"),
            round=round_number,
            iteration=out.iteration,
            state_path=str(latest_checkpoint(job.state_dir)),
            metrics={k: v for k, v in (out.history[-1] if out.history else {}).items() if isinstance(v, float)},
            mlflow_run_id=run_id,
        )
        if plot is not None:
            mlflow.log_artifact(str(plot), artifact_path="plots")
        if (folder / ADAPTER).is_dir():  # a LoRA round: the adapter beside the merged policy
            mlflow.log_artifacts(str(folder / ADAPTER), artifact_path=ADAPTER)
        _log_samples(out.samples, round_number)
        if is_last and tracking.register_models:
            register_policy(result, tracking, prefs, reward, reference)
        result.seconds = time.perf_counter() - start
    logger().info("round %d done: iteration %d, policy sha256 %s, %.1fs", round_number, out.iteration, result.sha256[:12], result.seconds)
    return result
