"""Training one PPO round, in this process or data-parallel across torchrun processes.

`ppo_round` (the Prefect task) describes the round as a `RoundJob`. With `ppo.processes == 1`
it calls `train_round` here; otherwise it writes the job to JSON and launches

    python -m torch.distributed.run --standalone --nproc-per-node N -m flows.workers JOB

whose every rank runs the same `train_round`. Rank 0 alone logs metrics to the task's MLflow
run, writes the in-round checkpoints and exports the policy, so the task reads the same
outputs whichever way the round ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from pydantic import BaseModel
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.faults import maybe_fail
from flows.refs import PreferenceSet, ReferenceRef, RewardModelRef
from flows.stages.common import fresh_tmp, logger, publish, read_prompt_file
from flows.tracking import MetricLogger
from ppo_core.config import DeviceConfig
from ppo_core.data.prompts import encode_prompts
from ppo_core.lm.checkpoint import latest_checkpoint, prune_checkpoints
from ppo_core.lm.distributed import DataParallel, shutdown
from ppo_core.ppo.metrics import MetricsCallback
from ppo_core.ppo.trainer import PPOTrainer
from ppo_core.ppo.value import CriticModel
from ppo_core.reward.model import RewardModel, RewardScorer


class RoundJob(BaseModel):
    """Everything a process needs to train one round (JSON, so a launcher can hand it over)."""

    settings: dict
    reference: ReferenceRef
    reward: RewardModelRef
    prefs: PreferenceSet
    round_number: int
    folder: str
    """The round's stage folder: state/ (checkpoints), policy/, history.json, samples.json."""
    previous_state: str | None = None
    """Checkpoint of round k-1 to continue from (None for round 1)."""
    run_id: str | None = None
    tracking_uri: str = ""

    @property
    def state_dir(self) -> Path:
        return Path(self.folder) / "state"

    @property
    def last_iteration(self) -> int:
        """The trainer's iteration counter when the round is done (rounds never stop early)."""
        return self.round_number * self.settings["ppo"]["iterations_per_round"]


class RoundOutput(BaseModel):
    iteration: int
    history: list[dict[str, float]]
    samples: list[dict]


def build_trainer(
    settings: dict,
    reference: ReferenceRef,
    reward: RewardModelRef,
    prefs: PreferenceSet,
    device: DeviceConfig,
    on_metrics: MetricsCallback | None,
    parallel: DataParallel | None = None,
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
        device=device, on_metrics=on_metrics, parallel=parallel,
    )


def _run_iterations(trainer: PPOTrainer, job: RoundJob) -> None:
    ppo = job.settings["ppo"]
    every, target = ppo["checkpoint_every"], job.last_iteration
    start = target - ppo["iterations_per_round"]
    if trainer.iteration < start:
        raise RuntimeError(f"round {job.round_number}: trainer at iteration {trainer.iteration}, expected {start}")
    progress = tqdm(
        total=target - start, initial=trainer.iteration - start, desc=f"PPO round {job.round_number}",
        unit="it", disable=not trainer.dp.is_main,
    )
    while trainer.iteration < target:
        metrics = trainer.step()
        progress.update(1)
        progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.2f}")
        local = trainer.iteration - start
        if local % every == 0 or trainer.iteration == target:
            trainer.save(job.state_dir)
        maybe_fail("ppo_round", job.round_number, local)
    progress.close()


def _export_policy(trainer: PPOTrainer, folder: Path) -> None:
    """Write the policy as a plain HF folder (LoRA merged: consumers need no peft)."""
    tmp = fresh_tmp(folder)
    policy = trainer.policy
    if hasattr(policy, "merge_and_unload"):
        policy = policy.merge_and_unload()
    policy.save_pretrained(tmp)
    trainer.tokenizer.save_pretrained(tmp)
    publish(tmp, folder)


def train_round(job: RoundJob, parallel: DataParallel | None = None) -> RoundOutput:
    """Build the trainer, continue from the in-round or the previous round's checkpoint, train
    to the round's last iteration, and (rank 0) export the policy and the round's records."""
    dp = parallel or DataParallel()
    device = DeviceConfig.model_validate(job.settings["orchestration"]["device"])
    metric_logger = MetricLogger(job.run_id if dp.is_main else None, job.tracking_uri)
    trainer = build_trainer(job.settings, job.reference, job.reward, job.prefs, device, metric_logger, dp)
    resumed = latest_checkpoint(job.state_dir)
    if resumed is not None:
        trainer.load(resumed)
        logger().info("round %d: resuming from in-round checkpoint %s", job.round_number, resumed.name)
    elif job.previous_state is not None:
        trainer.load(job.previous_state)
    _run_iterations(trainer, job)
    out = RoundOutput(iteration=trainer.iteration, history=metric_logger.history, samples=trainer.sample_table(8))
    if dp.is_main:
        folder = Path(job.folder)
        _export_policy(trainer, folder / "policy")
        # history is empty when the round resumed from its own final checkpoint
        (folder / "history.json").write_text(json.dumps(out.history))
        (folder / "samples.json").write_text(json.dumps(out.samples))
        # a finished round needs only the checkpoint the next round starts from (1.55 GB each
        # for SmolLM2: policy, value head, both AdamW states)
        prune_checkpoints(job.state_dir, keep_last=1)
    dp.barrier()
    return out


def train_round_in_processes(job: RoundJob, processes: int) -> RoundOutput:
    """Run `train_round` on `processes` torchrun ranks and read rank 0's outputs back."""
    spec = Path(job.folder) / "job.json"
    spec.write_text(job.model_dump_json())
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "flows.workers", str(spec),
    ]
    env = dict(os.environ)
    # a CPU rank gets an equal share of the cores (torchrun's default is 1 thread)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    logger().info("round %d: %s", job.round_number, " ".join(command))
    done = subprocess.run(command, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"round {job.round_number}: data-parallel training ({processes} processes) exited with "
            f"code {done.returncode}; its output is above, its checkpoints in {job.state_dir}"
        )
    folder = Path(job.folder)
    return RoundOutput(
        iteration=job.last_iteration,
        history=json.loads((folder / "history.json").read_text()),
        samples=json.loads((folder / "samples.json").read_text()),
    )


def main(argv: list[str]) -> int:
    """torchrun entry point: every rank trains the round described by the job file."""
    job = RoundJob.model_validate_json(Path(argv[0]).read_text())
    parallel = DataParallel.from_env()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    try:
        train_round(job, parallel)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
