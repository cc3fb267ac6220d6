"""What a Ray Train worker of the `ray` launcher (flows.ray_launcher) runs, in a module that is
light to import: Ray imports the module of the training function in the Train controller and in
every worker before anything runs, so what a round needs (torch, transformers, MLflow: the
imports of flows.workers) is imported only where and when a worker trains, and Prefect never.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import ray
import ray.train

ROSTER = "workers"
"""Folder (under a run's storage) where each worker records where it runs: rank-R.json."""


class SharedStorageError(RuntimeError):
    """A worker cannot see the run's storage: the work folder is not shared with its node."""


def worker_main(config: dict[str, Any]) -> Any:
    """What every Ray Train worker runs: check that it sees the storage, record where it runs,
    then fn(*args) on `threads` torch threads."""
    storage, where = Path(config["storage"]), whereabouts()
    if not storage.is_dir():
        raise SharedStorageError(
            f"{storage} does not exist on node {where['node_ip']} ({where['host']}): the work folder "
            "(orchestration.work_dir) must be on storage every Ray node mounts at the same path"
        )
    (storage / ROSTER / f"rank-{where['rank']}.json").write_text(json.dumps(where))
    import torch

    torch.set_num_threads(config["threads"])
    return config["fn"](*config["args"])


def train_round_worker(spec: str) -> dict[str, Any]:
    """Each worker: the round of the job file, in the process group Ray Train set up."""
    from flows.workers import RoundJob, train_round
    from ppo_core.lm.distributed import DataParallel

    job = RoundJob.model_validate_json(Path(spec).read_text())
    return train_round(job, DataParallel.from_env(sharding=job.ppo.sharding)).model_dump(mode="json")


def whereabouts() -> dict[str, Any]:
    """This worker's rank, pid, host, node IP and Ray node id."""
    return {
        "rank": ray.train.get_context().get_world_rank(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
    }
