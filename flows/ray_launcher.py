"""The `ray` launcher of a PPO round (`ppo.launcher: ray`): `flows.workers.train_round` on
`ppo.processes` Ray Train workers of a Ray cluster, the function torchrun's ranks run.

The Prefect task connects to the cluster (`ppo.ray.address`, else $RAY_ADDRESS) as a Ray driver
and gives Ray Train's `TorchTrainer` one function: each worker joins the process group Ray Train
has set up (gloo on CPU; NCCL with one GPU per worker), which `DataParallel.from_env` finds
initialised, reads the job file and trains the round as a torchrun rank would: same job, same
exactness, same sharding modes. Rank 0 logs to MLflow, checkpoints and exports the policy; its
RoundOutput comes back as the training function's return value.

Storage: the workers read the job, the reference, the reward model and the prompts from the work
folder, and rank 0 writes the round's checkpoints and exported policy into the round's folder,
which the task then reads. So `orchestration.work_dir` must be on a filesystem that every Ray node
mounts at the same path (one host: any folder; several: NFS or the like). A worker that cannot
see the round's folder fails the round saying so. Ray Train's own run state goes to ROUND/ray.
What the workers run is flows.ray_worker (light to import: Ray imports it in its Train controller).

Failures: a worker that dies or raises fails the round with one line naming each failed rank,
its pid, node IP and node id (from the roster each worker writes when it starts, ROUND/ray/workers);
the next run resumes the round from its last in-round checkpoint. `ppo.ray.max_failures` lets
Ray Train restart the worker group in place first, which resumes the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.exceptions import RayActorError
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from flows.config import RayLauncherConfig
from flows.ray_worker import ROSTER, train_round_worker, worker_main
from flows.runtime import DEFAULTS
from flows.stages.common import logger
from flows.workers import RoundJob, RoundOutput
from ppo_core.config import DeviceConfig

RUN_NAME = "train"
"""Ray Train's run folder under the storage (replaced by every launch)."""
FORWARDED = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *DEFAULTS)
"""Driver variables the workers get (with every RLHF_* one: fault drills reach the ranks as under
torchrun); logins are not forwarded: the nodes have their own (README "Ray")."""


class RoundFailed(RuntimeError):
    """A Ray round failed: the message is one line naming the failed workers and nodes."""


def train_round_on_ray(job: RoundJob) -> RoundOutput:
    """Train the round on `job.ppo.processes` Ray Train workers; rank 0's outputs come back."""
    spec = Path(job.folder) / "job.json"
    spec.write_text(job.model_dump_json())
    value = run_on_workers(
        train_round_worker, (str(spec),), job.ppo.processes, job.ppo.ray, job.device,
        storage=Path(job.folder) / "ray", what=f"round {job.round_number}",
        hint=f"its checkpoints are in {job.state_dir}: run again to resume from the last one",
    )
    return RoundOutput.model_validate(value)


def run_on_workers(
    fn: Callable[..., Any], args: tuple, processes: int, settings: RayLauncherConfig, device: DeviceConfig,
    storage: Path, what: str, hint: str = "",
) -> Any:
    """fn(*args) on `processes` Ray Train workers joined in one torch process group; returns rank
    0's return value, or raises RoundFailed naming the workers that failed. `fn` must be importable
    on the workers (pickled by reference) and `storage` a folder they all see."""
    roster = storage / ROSTER
    shutil.rmtree(roster, ignore_errors=True)
    shutil.rmtree(storage / RUN_NAME, ignore_errors=True)
    roster.mkdir(parents=True)
    with connected(settings.address, what):
        trainer = _trainer(fn, args, processes, settings, _use_gpu(device), storage)
        try:
            return trainer.fit().return_value
        except ray.train.WorkerGroupError as err:
            raise RoundFailed(failure_line(what, err.worker_failures, read_roster(roster), hint)) from err
        except ray.train.ControllerError as err:
            reason = f"Ray Train could not run the workers: {_first_line(err.controller_failure)}"
            raise RoundFailed(f"{what}: {reason}" + (f"; {hint}" if hint else "")) from err


def _trainer(
    fn: Callable[..., Any], args: tuple, processes: int, settings: RayLauncherConfig, use_gpu: bool, storage: Path
) -> TorchTrainer:
    threads = settings.cpus_per_worker
    env = {k: v for k, v in os.environ.items() if k.startswith("RLHF_") or k in FORWARDED}
    return TorchTrainer(
        worker_main,
        train_loop_config={"fn": fn, "args": args, "storage": str(storage), "threads": threads},
        scaling_config=ScalingConfig(
            num_workers=processes, use_gpu=use_gpu, resources_per_worker={"CPU": threads},
            placement_strategy=settings.placement,
        ),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(
            name=RUN_NAME, storage_path=str(storage),
            failure_config=FailureConfig(max_failures=settings.max_failures),
            worker_runtime_env={"env_vars": {**env, "OMP_NUM_THREADS": str(threads)}},
        ),
    )


@contextlib.contextmanager
def connected(address: str | None, what: str = "ray") -> Iterator[None]:
    """This process as a driver of the cluster for the block (a connection it already has is
    used and kept)."""
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise RoundFailed(
            f"{what}: no Ray cluster named: set ppo.ray.address or RAY_ADDRESS "
            "(HOST:6379, ray://HOST:10001, auto, or local for a one-machine Ray)"
        )
    logger().info("%s: connecting to the Ray cluster at %s", what, address)
    try:
        ray.init(address=address)
    except ConnectionError as err:
        raise RoundFailed(f"{what}: cannot reach the Ray cluster at {address}: {_first_line(err)}") from err
    try:
        yield
    finally:
        ray.shutdown()


def _use_gpu(device: DeviceConfig) -> bool:
    """One GPU per worker: with device cuda, or auto on a cluster that has GPUs."""
    if device.device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return device.device == "cuda"


# ---- reporting a failure -------------------------------------------------------------------


def read_roster(folder: Path) -> dict[int, dict[str, Any]]:
    """rank -> whereabouts, of the workers that started."""
    entries = (json.loads(p.read_text()) for p in folder.glob("rank-*.json"))
    return {entry["rank"]: entry for entry in entries}


def failure_line(what: str, failures: dict[int, BaseException], roster: dict[int, dict[str, Any]], hint: str = "") -> str:
    """One line: each failed rank with where it ran and what happened, the dead ones first."""
    ranks = sorted(failures, key=lambda r: (not _died(failures[r]), r))
    parts = [f"{_worker(rank, roster.get(rank))} {_what_happened(failures[rank])}" for rank in ranks]
    return f"{what}: " + "; ".join(parts or ["the Ray Train worker group failed"]) + (f"; {hint}" if hint else "")


def _died(error: BaseException) -> bool:
    """Ray Train's health check found the worker's process gone."""
    return isinstance(getattr(error, "health_check_failure", None), RayActorError)


def _what_happened(error: BaseException) -> str:
    if _died(error):
        return f"died ({_first_line(error.health_check_failure)})"
    return f"failed: {_first_line(error)}"


def _worker(rank: int, where: dict[str, Any] | None) -> str:
    if where is None:
        return f"Ray Train worker rank {rank} (before it started)"
    return (
        f"Ray Train worker rank {rank} (pid {where['pid']} on node {where['node_ip']}, "
        f"host {where['host']}, node id {where['node_id'][:12]})"
    )


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].strip()}" if lines else type(error).__name__
