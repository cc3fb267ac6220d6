"""What every process of a PPO round runs: build the trainer, resume, train, export.

`ppo_round` (the Prefect task) describes the round as a `RoundJob` and hands it to a launcher
(flows.launchers): in this process, or on N torchrun ranks through

    python -m torch.distributed.run --standalone --nproc-per-node N -m flows.workers JOB

whose every rank runs the same `train_round`. Rank 0 alone logs metrics to the task's MLflow
run, writes the in-round checkpoints and exports the policy, so the task reads the same
outputs whichever way the round ran. With `ppo.sharding: fsdp` every rank writes its shards of
each checkpoint (rank 0 publishes it), and the policy is gathered whole onto rank 0 to be exported.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from pydantic import BaseModel
from tqdm.auto import tqdm

from flows.config import PPOStageConfig
from flows.faults import kill_point, maybe_fail
from flows.refs import PreferenceSet, ReferenceRef, RewardModelRef
from flows.runtime import configure_heap, release_free_heap
from flows.stages.common import logger, placement, read_prompt_file
from flows.tracking import MetricLogger
from ppo_core.config import DeviceConfig
from ppo_core.data.config import PromptConfig
from ppo_core.data.prompts import encode_prompts
from ppo_core.lm.checkpoint import prune_checkpoints
from ppo_core.lm.distributed import DataParallel, shutdown
from ppo_core.lm.folders import replace_folder, temp_folder_for
from ppo_core.lm.lora import add_adapters_in_place, add_policy_adapters
from ppo_core.lm.models import load_causal_lm, load_tokenizer
from ppo_core.lm.sharding import full_state_dict
from ppo_core.ppo.metrics import MetricsCallback
from ppo_core.ppo.trainer import PPOTrainer
from ppo_core.ppo.value import CriticModel
from ppo_core.reward.model import RewardModel, RewardScorer


class RoundJob(BaseModel):
    """Everything a process needs to train one round (JSON, so a launcher can hand it over)."""

    ppo: PPOStageConfig
    prompts: PromptConfig
    device: DeviceConfig
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
        return self.round_number * self.ppo.iterations_per_round


class RoundOutput(BaseModel):
    iteration: int
    history: list[dict[str, float]]
    samples: list[dict]


ADAPTER = "adapter"  # beside the exported policy of a LoRA round


def build_trainer(job: RoundJob, on_metrics: MetricsCallback | None, parallel: DataParallel | None = None) -> PPOTrainer:
    """Models and data for PPO, all from the stage references."""
    ppo, reference = job.ppo, job.reference
    where = placement(job.device)
    tokenizer = load_tokenizer(reference.path)
    policy = where.place(load_causal_lm(reference.path))
    critic = None
    if ppo.algo.critic == "separate":  # built from the plain policy, before any adapter
        critic = where.place(
            CriticModel.from_pretrained(job.reward.path)
            if ppo.critic_init == "reward_model"
            else CriticModel.from_model(policy)
        )
    ref_model = None  # with LoRA: the policy's base, adapters disabled
    if ppo.lora:
        policy = add_policy_adapters(policy, ppo.lora)
        if critic is not None:
            add_adapters_in_place(critic.backbone, ppo.lora)
    elif ppo.sharding == "fsdp":  # frozen models stay whole on every rank (ppo_core.lm.sharding), in the compute dtype
        ref_model = where.freeze(load_causal_lm(reference.path))
    else:
        ref_model = where.place(load_causal_lm(reference.path))
    rm = where.freeze(RewardModel.from_pretrained(job.reward.path))  # scores every rollout: beside the policy
    texts = read_prompt_file(job.prefs.train_prompts_path)
    scorer = RewardScorer(rm, tokenizer, texts)
    prompt_ids = encode_prompts(tokenizer, texts, job.prompts)
    return PPOTrainer(
        ppo.effective_algo, ppo.sampling, policy, ref_model, critic, tokenizer, scorer, prompt_ids,
        device=job.device, on_metrics=on_metrics, parallel=parallel,
    )


def _run_iterations(trainer: PPOTrainer, job: RoundJob) -> None:
    every, target = job.ppo.checkpoint_every, job.last_iteration
    start = target - job.ppo.iterations_per_round
    if trainer.iteration < start:
        raise RuntimeError(f"round {job.round_number}: trainer at iteration {trainer.iteration}, expected {start}")
    with tqdm(
        total=target - start, initial=trainer.iteration - start, desc=f"PPO round {job.round_number}",
        unit="it", disable=not trainer.dp.is_main,
    ) as progress:  # closed (its line ended) on a failure too, before the error is reported
        while trainer.iteration < target:
            metrics = trainer.step()
            release_free_heap()  # what the heap kept of the iteration's frees: not the next one's memory
            progress.update(1)
            progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.2f}")
            local = trainer.iteration - start
            if local % every == 0 or trainer.iteration == target:
                trainer.save(job.state_dir)
            maybe_fail("ppo_round", job.round_number, local)
            kill_point(f"ppo_round_{job.round_number}:{local}")


def _whole_policy(trainer: PPOTrainer, job: RoundJob) -> torch.nn.Module | None:
    """The policy as one module on rank 0 (None on the others): the trainer's own, or under fsdp
    a copy built as build_trainer builds it and loaded with the shards gathered onto rank 0 (a
    collective: every rank calls this)."""
    if not trainer.dp.sharded:
        return trainer.policy if trainer.dp.is_main else None
    state = full_state_dict(trainer.policy)  # {} on ranks > 0
    if not trainer.dp.is_main:
        return None
    policy = load_causal_lm(job.reference.path)
    if job.ppo.lora:
        policy = add_policy_adapters(policy, job.ppo.lora)
    policy.load_state_dict(state, strict=True)
    return policy


def _export_policy(trainer: PPOTrainer, folder: Path, policy: torch.nn.Module | None = None) -> None:
    """Write the policy (the trainer's, or `policy`) as a plain HF folder (LoRA merged: consumers
    need no peft), and a LoRA policy's adapter alone beside it (folder/../adapter). Merging
    changes the policy in place: call this last."""
    tmp = temp_folder_for(folder)
    policy = trainer.policy if policy is None else policy
    if hasattr(policy, "merge_and_unload"):
        adapter = temp_folder_for(folder.parent / ADAPTER)
        policy.save_pretrained(adapter)
        replace_folder(adapter, folder.parent / ADAPTER)
        policy = policy.merge_and_unload()
    policy.save_pretrained(tmp)
    trainer.tokenizer.save_pretrained(tmp)
    replace_folder(tmp, folder)


def train_round(job: RoundJob, parallel: DataParallel | None = None) -> RoundOutput:
    """Build the trainer, continue from the in-round or the previous round's checkpoint, train
    to the round's last iteration, and (rank 0) export the policy and the round's records."""
    configure_heap()  # torchrun ranks and Ray workers start here, not in the pipeline
    dp = parallel or DataParallel()
    metric_logger = MetricLogger(job.run_id if dp.is_main else None, job.tracking_uri)
    trainer = build_trainer(job, metric_logger, dp)
    resumed = trainer.load(job.state_dir)  # `latest`, or the newest intact checkpoint if it is corrupt
    if resumed is not None:
        logger().info("round %d: resuming from in-round checkpoint %s", job.round_number, resumed.name)
    elif job.previous_state is not None:
        trainer.load(job.previous_state)
    _run_iterations(trainer, job)
    out = RoundOutput(iteration=trainer.iteration, history=metric_logger.history, samples=trainer.sample_table(8))
    policy = _whole_policy(trainer, job)
    if dp.is_main:
        folder = Path(job.folder)
        _export_policy(trainer, folder / "policy", policy)
        # history is empty when the round resumed from its own final checkpoint
        (folder / "history.json").write_text(json.dumps(out.history))
        (folder / "samples.json").write_text(json.dumps(out.samples))
        # a finished round needs only the checkpoint the next round starts from (1.55 GB each
        # for SmolLM2: policy, value head, both AdamW states)
        prune_checkpoints(job.state_dir, keep_last=1)
    dp.barrier()
    return out


def main(argv: list[str]) -> int:
    """torchrun entry point: every rank trains the round described by the job file."""
    job = RoundJob.model_validate_json(Path(argv[0]).read_text())
    parallel = DataParallel.from_env(sharding=job.ppo.sharding)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    try:
        train_round(job, parallel)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
