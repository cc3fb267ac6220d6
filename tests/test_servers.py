"""The production wiring of docker/compose.yaml, run for real without Docker.

PostgreSQL from Debian's `postgresql` package (initdb + pg_ctl in a temporary folder, as the
`postgres` user when we are root: postgres refuses to run as root), its databases made by
docker/initdb/create-databases.sh, then the compose file's own commands on loopback: `prefect
server start` against Postgres, `mlflow server` with the Postgres backend and `--serve-artifacts`
(a local folder standing in for the S3 bucket), init's `prefect work-pool create` and
`prefect concurrency-limit create`. The tiny pipeline runs as `rlhf run` in a subprocess that
knows the servers only by PREFECT_API_URL and MLFLOW_TRACKING_URI; then `rlhf deploy` puts it
in the `gpu` pool, the compose worker command runs it, and every check reads the servers' APIs
(and the Postgres tables behind them). Servers are stopped in the fixture's finaliser.

Skipped when PostgreSQL's binaries are missing, unless RLHF_REQUIRE_SERVERS=1 (CI), where a
missing server is a failure. Deselect with `-m "not servers"`.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

pytest.register_assert_rewrite("tests.docker_checks", "tests.servers_harness")

from tests.docker_checks import DOCKER, command_lines, environment, load_compose, option  # noqa: E402
from tests.pipeline_fixtures import TINY_CONFIG  # noqa: E402
from tests.servers_harness import (  # noqa: E402
    BIN,
    PG_PASSWORD,
    PG_USER,
    Postgres,
    Stack,
    free_port,
    postgres_bin,
    prefect_api,
    query,
    replace_option,
    run_cli,
    stage_of,
    tail,
    task_runs,
    unavailable,
    wait_for,
)

pytestmark = [pytest.mark.servers, pytest.mark.slow]

STAGES = {"snapshot_reference", "collect_preferences", "train_reward_model", "ppo_round", "evaluate"}
MODELS = {"tiny-reference", "tiny-reward-model", "tiny-policy"}
CRON = "0 3 * * *"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """PostgreSQL, the Prefect server and the MLflow server of docker/compose.yaml, on loopback,
    with init's work pool and concurrency limit; all stopped and removed afterwards."""
    bindir = postgres_bin()
    if bindir is None or not (bindir / "initdb").exists():
        unavailable("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    as_owner: list[str] = []
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            unavailable("running as root and there is no `postgres` user to run PostgreSQL as")
        if shutil.which("runuser") is None:
            unavailable("running as root and `runuser` is missing to drop to the postgres user")
        as_owner = ["runuser", "-u", "postgres", "--"]
    try:
        import psycopg  # noqa: F401  (the MLflow server's Postgres driver: the `servers` extra)
    except ImportError:
        unavailable("psycopg is not installed: pip install -e '.[servers]'")

    compose = load_compose()
    with ExitStack() as cleanup:
        # not under pytest's tmp_path: its parents are private to root and postgres must enter
        root = Path(tempfile.mkdtemp(prefix="rlhf-servers-"))
        cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        os.chmod(root, 0o755)
        pg_root = root / "pg"
        pg_root.mkdir(mode=0o700)
        pg = Postgres(bindir, pg_root, free_port(), as_owner)
        cleanup.callback(pg.stop)
        pg.start()

        # The databases, by the very script the postgres image runs on first start.
        pg_env = environment(compose["services"]["postgres"])
        script_env = {
            **os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PGHOST": "127.0.0.1", "PGPORT": str(pg.port),
            "PGPASSWORD": PG_PASSWORD, "PGDATABASE": "postgres", "POSTGRES_USER": PG_USER,
            "POSTGRES_MULTIPLE_DATABASES": pg_env["POSTGRES_MULTIPLE_DATABASES"],
        }
        made = subprocess.run(
            ["sh", str(DOCKER / "initdb" / "create-databases.sh")], env=script_env, capture_output=True, text=True
        )
        assert made.returncode == 0, made.stdout + made.stderr

        stack = Stack(root, pg, compose, artifacts=root / "artifacts")
        cleanup.callback(stack.stop_all)
        services = compose["services"]

        def database_url(url: str) -> str:
            """compose's URL (postgres:5432, .env credentials) -> this cluster on loopback"""
            return urlunsplit(urlsplit(url)._replace(netloc=f"{PG_USER}:{PG_PASSWORD}@127.0.0.1:{pg.port}"))

        prefect_port, mlflow_port = free_port(), free_port()
        prefect_argv = command_lines(services["prefect-server"])[0]
        prefect_argv = replace_option(replace_option(prefect_argv, "--host", "127.0.0.1"), "--port", str(prefect_port))
        server_env = {k: v for k, v in stack.client_env().items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
        stack.spawn("prefect-server", prefect_argv, {
            **server_env,
            "PREFECT_HOME": str(root / "server-prefect-home"),
            "PREFECT_UI_STATIC_DIRECTORY": str(root / "server-prefect-home" / "ui"),
            "PREFECT_API_DATABASE_CONNECTION_URL": database_url(
                environment(services["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"]
            ),
        })

        mlflow_argv = command_lines(services["mlflow"])[0]
        backend = database_url(option(mlflow_argv, "--backend-store-uri"))
        for name, value in (
            ("--host", "127.0.0.1"), ("--port", str(mlflow_port)), ("--workers", "1"),
            ("--backend-store-uri", backend), ("--artifacts-destination", str(stack.artifacts)),
        ):
            mlflow_argv = replace_option(mlflow_argv, name, value)
        stack.spawn("mlflow", mlflow_argv, server_env)

        stack.prefect_url = f"http://127.0.0.1:{prefect_port}/api"
        stack.mlflow_url = f"http://127.0.0.1:{mlflow_port}"
        stack.wait_healthy("prefect-server", f"{stack.prefect_url}/health")
        stack.wait_healthy("mlflow", f"{stack.mlflow_url}/health")

        # init's Prefect commands, verbatim (the bucket is MinIO's business, not tested here)
        for argv in command_lines(services["init"]):
            if argv[0] == "prefect":
                done = subprocess.run(
                    [str(BIN / "prefect"), *argv[1:]], env=stack.client_env(), capture_output=True, text=True, timeout=120
                )
                assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
        yield stack


@dataclass
class PipelineRun:
    flow_run_id: str
    work_dir: Path
    folder: Path
    stdout: str
    seconds: float


@pytest.fixture(scope="module")
def pipeline_run(stack: Stack) -> PipelineRun:
    """`rlhf run configs/tiny.yaml`, in a fresh folder, knowing the servers only by env."""
    folder = stack.root / "run"
    folder.mkdir()
    work_dir = stack.root / "work"  # absolute: the worker's flow run shares its cache
    start = time.perf_counter()
    result = run_cli(stack, "run", str(TINY_CONFIG), "--set", f"orchestration.work_dir={work_dir}", cwd=folder)
    seconds = time.perf_counter() - start
    match = re.search(r"Prefect flow run: ([0-9a-f-]{36})", result.stdout)
    assert match, result.stdout
    return PipelineRun(match.group(1), work_dir, folder, result.stdout, seconds)


@pytest.fixture(scope="module")
def deployment_run(stack: Stack, pipeline_run: PipelineRun) -> dict[str, Any]:
    """`rlhf deploy ... --work-pool gpu`, the compose worker command, one run of the deployment."""
    deployed = run_cli(
        stack, "deploy", str(TINY_CONFIG), "--cron", CRON, "--work-pool", "gpu",
        "--set", f"orchestration.work_dir={pipeline_run.work_dir}", cwd=pipeline_run.folder, timeout=300,
    )
    match = re.search(r"\(id ([0-9a-f-]{36})\)", deployed.stdout)
    assert match, deployed.stdout
    deployment = prefect_api(stack, "GET", f"/deployments/{match.group(1)}")

    worker = stack.compose["services"]["worker"]
    health_port = free_port()
    worker_env = stack.client_env(
        PREFECT_WORKER_WEBSERVER_PORT=str(health_port), PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_PREFETCH_SECONDS="5",
    )
    assert set(environment(worker)) - {"PREFECT_WORKER_WEBSERVER_PORT"} <= {"PREFECT_API_URL", "MLFLOW_TRACKING_URI"}
    stack.spawn("worker", command_lines(worker)[0], worker_env)
    stack.wait_healthy("worker", f"http://127.0.0.1:{health_port}/health", timeout=120)

    flow_run = prefect_api(stack, "POST", f"/deployments/{deployment['id']}/create_flow_run", json={})
    logs = [stack.root / "worker.log", stack.root / "prefect-server.log"]

    def finished() -> dict[str, Any] | None:
        run = prefect_api(stack, "GET", f"/flow_runs/{flow_run['id']}")
        return run if run["state"] and run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    final = wait_for(finished, 600, "the deployment's flow run did not finish", logs)
    return {"deployment": deployment, "flow_run": final, "logs": logs}


def test_flow_run_and_stage_runs_are_on_the_prefect_server(stack: Stack, pipeline_run: PipelineRun) -> None:
    flow_run = prefect_api(stack, "GET", f"/flow_runs/{pipeline_run.flow_run_id}")
    assert flow_run["state"]["type"] == "COMPLETED", flow_run["state"]
    runs = task_runs(stack, pipeline_run.flow_run_id)
    names = [stage_of(r) for r in runs]
    assert set(names) >= STAGES, names
    assert names.count("ppo_round") == 2, names
    assert {r["state"]["type"] for r in runs} == {"COMPLETED"}, [(r["name"], r["state"]["name"]) for r in runs]
    # the `gpu` tag limit init created was in force and let the GPU stages through
    limits = prefect_api(stack, "POST", "/concurrency_limits/filter", json={})
    assert [(c["tag"], c["concurrency_limit"]) for c in limits] == [("gpu", 1)]
    gpu_runs = [r for r in runs if "gpu" in r["tags"]]
    assert {stage_of(r) for r in gpu_runs} == {"ppo_round", "evaluate"}


def test_the_prefect_server_keeps_its_state_in_postgres(stack: Stack, pipeline_run: PipelineRun) -> None:
    rows = query(stack, "prefect", "SELECT state_type::text FROM flow_run WHERE id = %s", pipeline_run.flow_run_id)
    assert rows == [("COMPLETED",)]
    pools = query(stack, "prefect", "SELECT type FROM work_pool WHERE name = 'gpu'")
    assert pools == [("process",)]


def test_runs_and_metrics_are_on_the_mlflow_server(stack: Stack, pipeline_run: PipelineRun) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(stack.mlflow_url)
    experiment = client.get_experiment_by_name("tiny")
    assert experiment is not None and experiment.artifact_location.startswith("mlflow-artifacts:")
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{pipeline_run.flow_run_id}'"
    )
    parents = [r for r in runs if r.data.tags.get("rlhf.pipeline_run") == "true"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    stages = {r.data.tags.get("rlhf.stage"): r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(stages) == (STAGES - {"ppo_round"}) | {"ppo_round_1", "ppo_round_2"}, set(stages)
    kl = client.get_metric_history(stages["ppo_round_2"].info.run_id, "objective/kl")
    assert len(kl) >= 2, kl  # per-step PPO metrics, one per iteration
    assert stages["evaluate"].data.metrics, "evaluation metrics"
    # nothing was written beside the client: the MLflow data went over HTTP
    assert not any((pipeline_run.folder / name).exists() for name in ("mlruns", "mlflow.db", "mlartifacts"))


def test_models_are_registered_and_their_artifacts_served_by_the_server(
    stack: Stack, pipeline_run: PipelineRun, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(stack.mlflow_url)
    assert {m.name for m in client.search_registered_models()} == MODELS
    champion = client.get_model_version_by_alias("tiny-policy", "champion")
    assert f"models:/tiny-policy/{champion.version}" in pipeline_run.stdout
    rows = query(stack, "mlflow", "SELECT name FROM registered_models ORDER BY name")
    assert {r[0] for r in rows} == MODELS
    # the weights went through --serve-artifacts into the server's artifact store...
    assert list(stack.artifacts.rglob("MLmodel")), "no model files in the server's artifact destination"
    # ...and come back through it, as the README pulls the policy out of the registry
    out = tmp_path / "policy"
    run_cli(stack, "models", "get", "tiny-policy@champion", "--out", str(out), cwd=tmp_path, timeout=300)
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors")), sorted(p.name for p in out.iterdir())


def test_a_deployment_on_the_gpu_pool_runs_on_the_compose_worker(
    stack: Stack, pipeline_run: PipelineRun, deployment_run: dict[str, Any]
) -> None:
    deployment, flow_run = deployment_run["deployment"], deployment_run["flow_run"]
    assert deployment["work_pool_name"] == "gpu"
    assert [s["schedule"].get("cron") for s in deployment["schedules"]] == [CRON]
    assert flow_run["state"]["type"] == "COMPLETED", (
        f"{flow_run['state']}\n" + "\n".join(tail(p) for p in deployment_run["logs"])
    )
    # the worker's run found the first run's results: every stage is a cache hit
    runs = task_runs(stack, flow_run["id"])
    assert {r["state"]["name"] for r in runs} == {"Cached"}, [(r["name"], r["state"]["name"]) for r in runs]
    assert {stage_of(r) for r in runs} >= STAGES
    # and it tracked to the same MLflow server, as cached child runs of a new parent run
    from mlflow import MlflowClient

    client = MlflowClient(stack.mlflow_url)
    experiment = client.get_experiment_by_name("tiny")
    tracked = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run['id']}'"
    )
    cached = [r for r in tracked if r.data.tags.get("rlhf.cached") == "true"]
    assert len(cached) == 6, [(r.info.run_name, r.data.tags.get("rlhf.cached")) for r in tracked]
