"""Stage: one PPO round (k = 1..R), checkpointed inside itself.

A round continues the trainer state of round k-1 (policy, critic, optimisers, RNG, KL
controller, iteration counter), so R cached rounds equal one uninterrupted run. Inside the
round the trainer checkpoints atomically every `checkpoint_every` iterations into a folder
named by the round's cache key: a crash resumes from the last in-round checkpoint. With
`ppo.processes > 1` the round trains data-parallel in torchrun processes (flows.workers).
"""

from __future__ import annotations

import shutil
import time

import mlflow
import torch
from prefect import task
from prefect.artifacts import create_table_artifact

from flows.caching import key_from_parameters, sha256_tree
from flows.refs import PolicyCheckpoint, PreferenceSet, ReferenceRef, RewardModelRef
from flows.registration import register_policy
from flows.stages.common import logger, stage_dir
from flows.tracking import TrackingContext, stage_run
from flows.workers import RoundJob, RoundOutput, train_round, train_round_in_processes
from ppo_core.config import DeviceConfig
from ppo_core.eval.plots import plot_training_curves
from ppo_core.lm.checkpoint import latest_checkpoint


def _train_with_oom_retry(job: RoundJob) -> RoundOutput:
    """In this process; on CUDA out-of-memory retry with half the micro-batch (same effective
    batch), continuing from the last in-round checkpoint."""
    algo = job.settings["ppo"]["algo"]
    while True:
        try:
            return train_round(job)
        except torch.cuda.OutOfMemoryError:
            current = algo.get("micro_batch_size") or algo["batch_size"] // algo["num_mini_batches"]
            if not job.settings["ppo"]["oom_halve_micro_batch"] or current <= 1:
                raise
            algo["micro_batch_size"] = current // 2
            logger().warning("round %d: CUDA out of memory; retrying with micro_batch_size=%d", job.round_number, current // 2)
            torch.cuda.empty_cache()


def _log_samples(rows: list[dict], round_number: int, run_id: str | None) -> None:
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
    folder = stage_dir(work_dir, "ppo_round", key)
    job = RoundJob(
        settings=settings, reference=reference, reward=reward, prefs=prefs, round_number=round_number,
        folder=str(folder), previous_state=previous.state_path if previous is not None else None,
        tracking_uri=tracking.uri,
    )
    if restart and job.state_dir.exists():
        # --force: the in-round checkpoints of an earlier run of this key would be "resumed",
        # finished ones included, and the round would recompute nothing.
        shutil.rmtree(job.state_dir)
    device = DeviceConfig.model_validate(settings["orchestration"]["device"])
    on_gpu = torch.cuda.is_available() and device.device != "cpu"
    processes = settings["ppo"]["processes"]
    with stage_run(tracking, f"ppo_round_{round_number}", {"rlhf.round": str(round_number)}, on_gpu) as run_id:
        job.run_id = run_id
        out = train_round_in_processes(job, processes) if processes > 1 else _train_with_oom_retry(job.model_copy(deep=True))
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
        if run_id is not None:
            if plot is not None:
                mlflow.log_artifact(str(plot), artifact_path="plots")
            _log_samples(out.samples, round_number, run_id)
            if is_last and settings["tracking"]["register_models"]:
                register_policy(result, tracking, prefs, reward, reference)
        result.seconds = time.perf_counter() - start
    logger().info("round %d done: iteration %d, policy sha256 %s, %.1fs", round_number, out.iteration, result.sha256[:12], result.seconds)
    return result
