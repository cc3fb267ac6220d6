"""For tests/test_ray.py: a Ray cluster of two nodes on this machine, a head and one more worker
node, each its own raylet (ray.cluster_utils, Ray's own multi-node test harness), with small CPU
counts and token authentication on (as docker/compose.yaml runs it), stopped when the block ends,
also on failure; and what its Ray Train workers run. Worker processes import `tests.*`
(PYTHONPATH is the repository while the nodes start). This process and its children are the
cluster's drivers while it runs: they have its token.

    python -m tests.ray_cluster     # start one, print its address; stop it with Ctrl-C or SIGTERM
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARDINGS = ("none", "fsdp")
CRITICS = ("separate", "shared")
NODE_ENV = {
    "PYTHONPATH": str(REPO),
    "RAY_USAGE_STATS_ENABLED": "0",
    "OMP_NUM_THREADS": "1",
}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class LocalCluster:
    address: str
    """The head's GCS, what RAY_ADDRESS names."""
    dashboard: str
    """http://HOST:PORT of the head's dashboard."""
    auth_env: dict[str, str]
    """What a driver needs to be let in: RAY_AUTH_MODE=token and the token."""
    start_s: float
    """Seconds the two nodes took to start."""


@contextlib.contextmanager
def local_cluster(head_cpus: int = 2, worker_cpus: int = 1) -> Iterator[LocalCluster]:
    """A head (with the dashboard, on a free port) and one more node; both stopped at the end."""
    from ray.cluster_utils import Cluster

    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(24)}
    start = time.perf_counter()
    cluster = None
    with _token_auth(auth):
        try:
            with _environment(NODE_ENV):
                cluster = Cluster(initialize_head=True, head_node_args={
                    "num_cpus": head_cpus, "include_dashboard": True, "dashboard_port": free_port(),
                    "dashboard_agent_listen_port": None,  # a free one, not 52365
                })
                cluster.add_node(num_cpus=worker_cpus)
            yield LocalCluster(cluster.address, f"http://{cluster.webui_url}", auth, time.perf_counter() - start)
        finally:
            import ray

            ray.shutdown()  # a driver connection left open would make the head refuse to stop
            if cluster is not None:
                cluster.shutdown()


@contextlib.contextmanager
def _token_auth(auth: dict[str, str]) -> Iterator[None]:
    """This process (and what it starts) in token mode for the block. Ray reads the mode once
    per process, so its cached config is refreshed on the way in and out (Ray's own test
    utility; a deployment sets the variables before Ray is imported)."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    with _environment(auth):
        reset_auth_token_state()
        try:
            yield
        finally:
            os.environ.pop("RAY_AUTH_MODE")
            reset_auth_token_state()


def train_sharding_modes(out: str, iterations: int) -> None:
    """On each Ray Train worker: tests/dist_worker.py's trainer (fixed responses) for each
    sharding mode and critic, `iterations` steps in the process group Ray Train set up; rank 0
    saves the histories and the whole weights to OUT/results.pt ({sharding: {critic: ...}})."""
    import torch

    from ppo_core.lm.distributed import DataParallel
    from tests import dist_worker, fsdp_worker

    results: dict[str, dict[str, Any]] = {}
    for sharding in SHARDINGS:
        results[sharding] = {}
        for critic in CRITICS:
            dp = DataParallel.from_env(sharding=sharding)
            trainer = dist_worker.build(dp, critic)
            history = [trainer.step() for _ in range(iterations)]
            weights = fsdp_worker.weights(trainer)  # gathered onto rank 0 when sharded
            results[sharding][critic] = {"history": history, "kl_coef": trainer.kl_ctl.value, **weights}
    if dp.is_main:
        torch.save(results, Path(out) / "results.pt")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.suppress(KeyboardInterrupt), local_cluster() as cluster:
        exports = " ".join(f"{k}={v}" for k, v in {"RAY_ADDRESS": cluster.address, **cluster.auth_env}.items())
        print(f"export {exports}   # started in {cluster.start_s:.1f}s; dashboard {cluster.dashboard}", flush=True)
        while True:
            time.sleep(3600)
