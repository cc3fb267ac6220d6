"""The `ray` launcher (flows.ray_launcher) on a real two-node Ray cluster started here
(tests/ray_cluster.py: a head and one more worker node on this machine, stopped at the end):

- two Ray Train workers (one per node, gloo) train exactly as one process does on the same
  samples, for `ppo.sharding` none and fsdp, with the tolerance of tests/test_distributed.py;
- the cluster refuses a driver without its token (token auth, as docker/compose.yaml runs it);
- the tiny pipeline with `ppo.launcher: ray` (2 workers, fsdp) runs its rounds on the cluster
  and registers its models;
- a Ray Train worker SIGKILLed mid-round fails the round with one `error:` line naming its rank,
  pid, node IP and node id; the next `rlhf run` resumes the round from its last in-round
  checkpoint (earlier stages cached) and ends with the uninterrupted Ray run's policy.

No part of Ray is mocked. The cluster is shared by the module (its start-up costs seconds).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flows.config import ConfigError, RayLauncherConfig
from flows.ray_launcher import RoundFailed, connected, failure_line, read_roster, run_on_workers
from ppo_core.config import DeviceConfig
from ppo_core.lm.checkpoint import checkpoint_name
from tests import dist_worker
from tests.pipeline_fixtures import (
    PPO_STAGES,
    TINY_CONFIG,
    UPSTREAM,
    Run,
    load_cfg,
    metric_steps,
    registry_snapshot,
    run_cli,
    run_pipeline,
)
from tests.ray_cluster import CRITICS, SHARDINGS, LocalCluster, local_cluster, train_sharding_modes
from tests.test_distributed import EXACT_KEYS

pytest_plugins = ["tests.pipeline_fixtures"]

ITERATIONS = 3
SPREAD = RayLauncherConfig(placement="SPREAD")  # one worker per node: the group spans both raylets
PER_ROUND = 4  # round 2 is iterations 5..8: a kill after its first checkpoint leaves 3 to go
# fsdp: its checkpoints hold every rank's RNG state, so a resumed round samples exactly what the
# uninterrupted one does (a plain data-parallel checkpoint holds rank 0's only, and the ranks
# reseed on loading: the resumed round is a different, equally valid, continuation)
RAY_RUN = [
    "ppo.launcher=ray", "ppo.processes=2", "ppo.sharding=fsdp", "ppo.ray.placement=SPREAD",
    f"ppo.iterations_per_round={PER_ROUND}",
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """The module's cluster; this process and the CLI runs it starts present its token."""
    with local_cluster() as running:
        yield running


def test_the_cluster_refuses_a_driver_without_its_token_but_not_a_healthcheck(cluster: LocalCluster) -> None:
    """Token authentication, as docker/compose.yaml turns it on: Ray runs any code a driver
    sends, so only holders of the token may connect; the health endpoints stay open."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_gcs_server_port_wait_time_s"] = "2"  # 2 tries, not 20
    code = f"import ray; ray.init(address={cluster.address!r})"
    stranger = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert stranger.returncode != 0 and "Failed to connect to Ray cluster" in stranger.stderr, stranger.stderr[-2000:]
    with urllib.request.urlopen(f"{cluster.dashboard}/api/gcs_healthz", timeout=10) as answer:
        assert answer.status == 200


# --- exactness -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_ray(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    storage = tmp_path_factory.mktemp("ray-exactness")
    start = time.perf_counter()
    run_on_workers(
        train_sharding_modes, (str(storage), ITERATIONS), 2, SPREAD.model_copy(update={"address": cluster.address}),
        DeviceConfig(device="cpu"), storage=storage, what="exactness run",
    )
    seconds = time.perf_counter() - start
    results = torch.load(storage / "results.pt", weights_only=False)
    return {"results": results, "roster": read_roster(storage / "workers"), "seconds": seconds}


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, Any]]:
    results = {}
    for critic in CRITICS:
        trainer = dist_worker.build(critic=critic)
        history = [trainer.step() for _ in range(ITERATIONS)]
        results[critic] = {"history": history, "kl_coef": trainer.kl_ctl.value,
                           "policy": trainer.policy.state_dict(), "value": trainer.value_module.state_dict()}
    return results


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("critic", CRITICS)
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_two_ray_workers_train_exactly_like_one_process(
    sharding: str, critic: str, on_ray: dict[str, Any], one_process: dict[str, dict[str, Any]]
) -> None:
    got, expected = on_ray["results"][sharding][critic], one_process[critic]
    for it, (m2, m1) in enumerate(zip(got["history"], expected["history"], strict=True)):
        for key in EXACT_KEYS:
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), f"iteration {it + 1}: {key}"
    assert got["kl_coef"] == pytest.approx(expected["kl_coef"], rel=1e-6)
    start = dist_worker.build(critic=critic)  # training moved the weights: equality means something
    assert _max_diff(expected["policy"], start.policy.state_dict()) > 1e-3
    assert _max_diff(got["policy"], expected["policy"]) < 1e-5
    assert _max_diff(got["value"], expected["value"]) < 1e-5


def test_the_workers_ran_on_both_nodes_of_the_cluster(on_ray: dict[str, Any], cluster: LocalCluster) -> None:
    roster = on_ray["roster"]
    assert sorted(roster) == [0, 1]
    assert roster[0]["node_id"] != roster[1]["node_id"]  # SPREAD: one raylet each
    assert roster[0]["pid"] != os.getpid() != roster[1]["pid"]
    print(f"\nRay: 2-node cluster up in {cluster.start_s:.1f}s; the exactness run took {on_ray['seconds']:.1f}s")


# --- the launcher's own checks ----------------------------------------------------------------


def test_the_launcher_is_checked_and_not_part_of_the_cache_key() -> None:
    from flows.keys import ppo_key

    with pytest.raises(ConfigError, match=r"ppo\.launcher: local runs the round in the task's own process"):
        load_cfg(["ppo.launcher=local", "ppo.processes=2"])
    with pytest.raises(ConfigError, match=r"ppo\.ray\.max_failures"):
        load_cfg(["ppo.ray.max_failures=-2"])
    refs = [SimpleNamespace(sha256=digest) for digest in "abc"]  # the key reads only their hashes
    keys = {ppo_key(load_cfg(sets), 1, *refs, None) for sets in ([], ["ppo.launcher=ray", "ppo.ray.address=local"])}
    assert len(keys) == 1


def test_without_an_address_the_round_says_where_to_name_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    no_cluster = pytest.raises(RoundFailed, match=r"^round 1: no Ray cluster named: set ppo\.ray\.address or RAY_ADDRESS")
    with no_cluster, connected(None, "round 1"):
        pass


def test_a_failure_is_one_line_naming_dead_workers_first() -> None:
    from ray.exceptions import ActorDiedError

    class HealthCheckFailed(Exception):  # the shape of Ray Train's error for a dead worker
        def __init__(self, failure: BaseException) -> None:
            super().__init__("A worker health check failed.\nWorker info: ...")
            self.health_check_failure = failure

    roster = {1: {"rank": 1, "pid": 42, "host": "gpu-7", "node_ip": "10.0.0.7", "node_id": "ab" * 28}}
    failures = {0: RuntimeError("Connection reset by peer\ntraceback..."), 1: HealthCheckFailed(ActorDiedError())}
    line = failure_line("round 2", failures, roster, "run again")
    assert "\n" not in line
    assert line.startswith(
        f"round 2: Ray Train worker rank 1 (pid 42 on node 10.0.0.7, host gpu-7, node id {'ab' * 6}) died (ActorDiedError: "
    )
    assert line.endswith("; Ray Train worker rank 0 (before it started) failed: RuntimeError: Connection reset by peer; run again")


# --- the pipeline on the cluster ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_run(pipeline_env: Path, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The tiny pipeline, its rounds on 2 Ray Train workers (one per node, fsdp), uninterrupted."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ADDRESS", cluster.address)
        return run_pipeline(tmp_path_factory.mktemp("ray-run"), RAY_RUN)


def _round_folders(run: Run) -> list[Path]:
    return [p.parent for p in sorted((run.folder / ".rlhf" / "tiny" / "stages" / "ppo_round").glob("*/policy"))]


@pytest.mark.slow
def test_pipeline_rounds_run_on_ray_workers_and_register_the_models(ray_run: Run) -> None:
    assert ray_run.result is not None, f"the Ray run failed: {ray_run.error!r}"
    assert all(ray_run.stages[s] == "Completed" for s in (*UPSTREAM, *PPO_STAGES))
    # rank 0 alone logs: every iteration exactly once
    assert metric_steps(ray_run, "ppo_round_1") == list(range(1, PER_ROUND + 1))
    assert metric_steps(ray_run, "ppo_round_2") == list(range(PER_ROUND + 1, 2 * PER_ROUND + 1))
    rounds = _round_folders(ray_run)
    assert len(rounds) == 2
    for folder in rounds:
        roster = read_roster(folder / "ray" / "workers")
        assert sorted(roster) == [0, 1] and roster[0]["node_id"] != roster[1]["node_id"], roster
        assert (folder / "job.json").is_file() and (folder / "policy" / "model.safetensors").is_file()
    registry = registry_snapshot(ray_run.tracking_uri)
    assert set(registry) == {"tiny-reference", "tiny-reward-model", "tiny-policy"}
    assert Path(ray_run.result["policy_path"]).parent in rounds


class _KillRankOne:
    """Watches a run's work folder: once round 2's first checkpoint is published, SIGKILLs the
    Ray Train worker of rank 1 (its pid from the roster the workers write)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.killed, self.stop = folder, None, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        first = checkpoint_name(PER_ROUND + 1)
        while not self.stop.wait(0.05):
            for latest in (self.folder / ".rlhf" / "tiny" / "stages" / "ppo_round").glob("*/state/latest"):
                if latest.read_text().strip() == first:
                    round_folder = latest.parent.parent
                    self.killed = read_roster(round_folder / "ray" / "workers")[1] | {"folder": round_folder}
                    os.kill(self.killed["pid"], signal.SIGKILL)
                    return

    @contextlib.contextmanager
    def watching(self) -> Iterator[_KillRankOne]:
        self.thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            self.thread.join()


@pytest.mark.slow
def test_a_killed_ray_worker_fails_the_round_naming_it_and_the_rerun_resumes(
    ray_run: Run, cluster: LocalCluster, tmp_path: Path
) -> None:
    assert ray_run.result is not None, f"the Ray run failed: {ray_run.error!r}"
    from prefect.settings import PREFECT_API_URL

    command = ["run", str(TINY_CONFIG), *[arg for item in RAY_RUN for arg in ("--set", item)]]
    # the session's Prefect server (the CLI then starts no temporary one) and the test cluster
    env = {"RAY_ADDRESS": cluster.address, "PREFECT_API_URL": PREFECT_API_URL.value()}
    with _KillRankOne(tmp_path).watching() as killer:
        failed = run_cli(*command, cwd=tmp_path, env=env, timeout=600)
    dead = killer.killed
    assert dead is not None, f"round 2 never checkpointed: {failed.stderr[-3000:]}"
    # the workers' own tracebacks reach stderr through Ray's log forwarding (as torchrun ranks'
    # do); the round's failure is one line
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert failed.returncode == 1 and len(errors) == 1, failed.stderr[-3000:]
    assert errors[0].startswith(
        f"error: ppo_round_2 failed: RoundFailed: round 2: Ray Train worker rank 1 (pid {dead['pid']} on node "
        f"{dead['node_ip']}, host {dead['host']}, node id {dead['node_id'][:12]}) died (ActorDiedError"
    ), errors[0]
    assert f"its checkpoints are in {dead['folder'] / 'state'}: run again to resume from the last one" in errors[0]
    last = (dead["folder"] / "state" / "latest").read_text().strip()
    rerun = run_cli(*command, cwd=tmp_path, env=env, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"round 2: resuming from in-round checkpoint {last}" in rerun.stderr
    for stage in (*UPSTREAM, "ppo_round_1"):
        assert re.search(rf"^\s*{stage}\s+Cached$", rerun.stdout, re.MULTILINE), (stage, rerun.stdout)
    assert f"sha256 {ray_run.result['policy_sha256']}" in rerun.stdout
