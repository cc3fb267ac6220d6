"""Launchers of a PPO round: where the processes that run `flows.workers.train_round` live.

- `local` (train_round_in_process): this process, retrying with a smaller micro-batch on CUDA
  out-of-memory;
- `torchrun`: N ranks on this host, torch.distributed's own launcher;
- `ray`: N Ray Train workers of a Ray cluster (flows.ray_launcher);
`auto` is local for one process, torchrun for more. Rank 0 of each writes the outputs the task
then reads (flows.workers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from flows.stages.common import logger
from flows.workers import RoundJob, RoundOutput, train_round


def launch_round(job: RoundJob) -> RoundOutput:
    """Train the round with the launcher its config asks for."""
    if job.ppo.launcher == "ray":
        from flows.ray_launcher import train_round_on_ray  # ray is an optional extra

        return train_round_on_ray(job)
    if job.ppo.launcher == "torchrun" or (job.ppo.launcher == "auto" and job.ppo.processes > 1):
        return train_round_in_processes(job, job.ppo.processes)
    return train_round_in_process(job)


def train_round_in_process(job: RoundJob) -> RoundOutput:
    """In this process; on CUDA out-of-memory retry with a smaller micro-batch (same effective
    batch), continuing from the last in-round checkpoint."""
    while True:
        try:
            return train_round(job)
        except torch.cuda.OutOfMemoryError:
            algo = job.ppo.algo
            smaller = smaller_micro_batch(algo.mini_batch_size, algo.effective_micro_batch_size)
            if not job.ppo.oom_halve_micro_batch or smaller is None:
                raise
            logger().warning("round %d: CUDA out of memory; retrying with micro_batch_size=%d", job.round_number, smaller)
            job = job.model_copy(update={"ppo": job.ppo.model_copy(update={"algo": algo.model_copy(update={"micro_batch_size": smaller})})})
            torch.cuda.empty_cache()


def smaller_micro_batch(mini_batch: int, current: int) -> int | None:
    """The largest micro-batch at most half of `current` that divides the minibatch (so the
    accumulated gradient is unchanged); None when `current` is already 1."""
    return next((size for size in range(current // 2, 0, -1) if mini_batch % size == 0), None)


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
