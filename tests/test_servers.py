"""The production wiring of docker/compose.yaml, run for real without Docker.

PostgreSQL from Debian's `postgresql` package (initdb + pg_ctl in a temporary folder, as the
`postgres` user when we are root: postgres refuses to run as root), its databases made by
docker/initdb/create-databases.sh, then the compose file's own commands and environments on
loopback, with a docker/.env made from the example (`filled_env`): `prefect server start`
against Postgres with basic auth, `mlflow server --app-name basic-auth` with the Postgres
backend, its users in Postgres too (docker/mlflow-auth.ini) and `--serve-artifacts` (a local
folder standing in for the S3 bucket), init's `prefect work-pool create` and `prefect
concurrency-limit create`. The tiny pipeline runs as `rlhf run` in a subprocess that knows the
servers only by PREFECT_API_URL and MLFLOW_TRACKING_URI and logs in as the compose worker does;
then `rlhf deploy` puts it in the `gpu` pool, the compose worker command runs it, and every
check reads the servers' APIs (and the Postgres tables behind them). Clients without the
login are refused. Servers are stopped in the fixture's finaliser.

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

from tests.docker_checks import (  # noqa: E402
    DOCKER,
    command_lines,
    environment,
    filled_env,
    load_compose,
    mlflow_auth_config,
    option,
)
from tests.pipeline_fixtures import TINY_CONFIG  # noqa: E402
from tests.servers_harness import (  # noqa: E402
    BIN,
    LOGIN_KEYS,
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
    status_of,
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
    try:
        import flask_wtf  # noqa: F401  (what `mlflow server --app-name basic-auth` imports)
    except ImportError:
        unavailable("Flask-WTF is not installed (MLflow's basic-auth app): pip install 'mlflow[auth]'")

    # docker/.env as the example says to make it; the database login is this cluster's
    compose = load_compose(env=filled_env(POSTGRES_USER=PG_USER, POSTGRES_PASSWORD=PG_PASSWORD))
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

        services = compose["services"]
        logins = {k: v for k, v in environment(services["worker"]).items() if k in LOGIN_KEYS}
        assert set(logins) == set(LOGIN_KEYS), logins
        stack = Stack(root, pg, compose, artifacts=root / "artifacts", logins=logins)
        cleanup.callback(stack.stop_all)

        def on_loopback(url: str) -> str:
            """compose's database URL (postgres:5432) -> this cluster, the same login if any"""
            login = urlsplit(url).netloc.rpartition("@")[0]
            return urlunsplit(urlsplit(url)._replace(netloc=f"{login}@127.0.0.1:{pg.port}".lstrip("@")))

        # The servers get their compose environment (logins, secrets) and no client login.
        server_env = {k: v for k, v in stack.client_env().items() if k not in (*LOGIN_KEYS, "PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
        prefect_port, mlflow_port = free_port(), free_port()
        prefect_argv = command_lines(services["prefect-server"])[0]
        prefect_argv = replace_option(replace_option(prefect_argv, "--host", "127.0.0.1"), "--port", str(prefect_port))
        prefect_env = environment(services["prefect-server"])
        stack.spawn("prefect-server", prefect_argv, {
            **server_env,
            **prefect_env,
            "PREFECT_HOME": str(root / "server-prefect-home"),
            "PREFECT_UI_STATIC_DIRECTORY": str(root / "server-prefect-home" / "ui"),
            "PREFECT_API_DATABASE_CONNECTION_URL": on_loopback(prefect_env["PREFECT_API_DATABASE_CONNECTION_URL"]),
        })

        # MLflow's auth config as compose mounts it, its users' database on this cluster
        auth = mlflow_auth_config(services["mlflow"])
        auth["database_uri"] = on_loopback(auth["database_uri"])
        auth_config = root / "mlflow-auth.ini"
        auth_config.write_text("[mlflow]\n" + "".join(f"{k} = {v}\n" for k, v in auth.items()))
        mlflow_argv = command_lines(services["mlflow"])[0]
        for name, value in (
            ("--host", "127.0.0.1"), ("--port", str(mlflow_port)), ("--workers", "1"),
            ("--backend-store-uri", on_loopback(option(mlflow_argv, "--backend-store-uri"))),
            ("--artifacts-destination", str(stack.artifacts)),
        ):
            mlflow_argv = replace_option(mlflow_argv, name, value)
        mlflow_env = {**environment(services["mlflow"]), "MLFLOW_AUTH_CONFIG_PATH": str(auth_config)}
        stack.spawn("mlflow", mlflow_argv, {**server_env, **mlflow_env})

        stack.prefect_url = f"http://127.0.0.1:{prefect_port}/api"
        stack.mlflow_url = f"http://127.0.0.1:{mlflow_port}"
        stack.wait_healthy("prefect-server", f"{stack.prefect_url}/health")
        stack.wait_healthy("mlflow", f"{stack.mlflow_url}/health")
        # /health answers before the tracking store does: the first API request opens the Postgres
        # store, which on a loaded 2-core box took longer than the CLI's 10 s fail-fast timeout
        login = (stack.logins["MLFLOW_TRACKING_USERNAME"], stack.logins["MLFLOW_TRACKING_PASSWORD"])
        stack.wait_healthy("mlflow", f"{stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1", auth=login)

        # init's Prefect commands, verbatim (the bucket is MinIO's business, not tested here)
        for argv in command_lines(services["init"]):
            if argv[0] == "prefect":
                done = subprocess.run(
                    [str(BIN / "prefect"), *argv[1:]], env=stack.client_env(), capture_output=True, text=True, timeout=120
                )
                assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
        yield stack


@pytest.fixture
def mlflow_client(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An MlflowClient of the server, logged in as the worker is (MLflow reads the environment)."""
    from mlflow import MlflowClient

    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, stack.logins[key])
    return MlflowClient(stack.mlflow_url)


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
    # the worker's compose environment: the two URLs and the logins, as client_env has them, and
    # the Ray head's address and token (tests/test_ray.py: here rounds run with the default launcher)
    ray_client = {"RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
    assert set(environment(worker)) - {"PREFECT_WORKER_WEBSERVER_PORT"} - ray_client <= {
        "PREFECT_API_URL", "MLFLOW_TRACKING_URI", *LOGIN_KEYS}
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


def test_runs_and_metrics_are_on_the_mlflow_server(pipeline_run: PipelineRun, mlflow_client: Any) -> None:
    client = mlflow_client
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
    stack: Stack, pipeline_run: PipelineRun, mlflow_client: Any, tmp_path: Path
) -> None:
    client = mlflow_client
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
    stack: Stack, pipeline_run: PipelineRun, deployment_run: dict[str, Any], mlflow_client: Any
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
    client = mlflow_client
    experiment = client.get_experiment_by_name("tiny")
    tracked = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run['id']}'"
    )
    cached = [r for r in tracked if r.data.tags.get("rlhf.cached") == "true"]
    assert len(cached) == 6, [(r.info.run_name, r.data.tags.get("rlhf.cached")) for r in tracked]


def test_the_servers_refuse_clients_without_the_login_but_not_the_healthchecks(stack: Stack) -> None:
    """401 without credentials, with a wrong password or an unknown user, on both APIs; 200 with
    the worker's login, and on the health endpoints the compose healthchecks probe, without one."""
    mlflow_login = f"{stack.logins['MLFLOW_TRACKING_USERNAME']}:{stack.logins['MLFLOW_TRACKING_PASSWORD']}"
    probes = [
        ("POST", f"{stack.prefect_url}/flows/filter", stack.logins["PREFECT_API_AUTH_STRING"]),
        ("GET", f"{stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1", mlflow_login),
    ]
    for method, url, login in probes:
        user, password = login.split(":", 1)
        assert status_of(method, url, login) == 200, url
        for wrong in (None, f"{user}:{password}x", f"{user}:", f"someone-else:{password}"):
            assert status_of(method, url, wrong) == 401, (url, wrong)
    for url in (f"{stack.prefect_url}/health", f"{stack.mlflow_url}/health"):
        assert status_of("GET", url, None) == 200, url
    # MLflow's users live in Postgres too, its admin made from the .env's login
    users = query(stack, "mlflow_auth", "SELECT username, is_admin FROM users")
    assert users == [(stack.logins["MLFLOW_TRACKING_USERNAME"], True)], users


@pytest.mark.parametrize(
    ("dropped", "expected"),
    [
        (("PREFECT_API_AUTH_STRING",), "the Prefect server refused the login (401): set PREFECT_API_AUTH_STRING=user:password"),
        (("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
         "the MLflow server refused the login (401): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"),
    ],
    ids=["prefect", "mlflow"],
)
def test_rlhf_run_without_a_login_is_one_line_naming_what_to_set(
    stack: Stack, tmp_path: Path, dropped: tuple[str, ...], expected: str
) -> None:
    env = {k: v for k, v in stack.client_env().items() if k not in dropped}
    result = subprocess.run(
        [str(BIN / "rlhf"), "run", str(TINY_CONFIG), "--set", f"orchestration.work_dir={tmp_path / 'work'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and errors[0].endswith(expected), errors
