"""docker/ credentials, checked statically (no Docker engine here): secrets have no defaults
and never appear on a command line or in an image, compose refuses to start without each one,
and both servers require the login their clients are given. tests/test_servers.py checks the
same logins against the real servers on loopback.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

pytest.register_assert_rewrite("tests.docker_checks")

from tests.docker_checks import (  # noqa: E402
    COMMAND_FIELDS,
    COMPOSE,
    COMPOSE_CPU,
    DOCKER,
    DOCKERFILES,
    REPO,
    MissingVariable,
    bind_mount,
    command_lines,
    env_example,
    environment,
    filled_env,
    healthcheck_code,
    is_secret,
    load_compose,
    mlflow_auth_config,
    option,
    raw_compose,
    secrets_named,
    variables,
)

pytest_plugins = ["tests.docker_checks"]  # the compose and services fixtures


def test_settings_have_documented_defaults_and_secrets_have_none() -> None:
    documented = env_example()
    secrets = set()
    for path in (COMPOSE, COMPOSE_CPU):
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        for name, op, value in variables(text):
            assert name in documented, f"{path.name}: {name} is not in .env.example"
            if is_secret(name):
                secrets.add(name)
                assert op == ":?", f"{path.name}: ${name} is a secret: `${{{name}:?...}}`, never a default"
                assert "copy docker/.env.example to docker/.env" in value, f"{path.name}: ${name}: {value!r}"
                assert documented[name] == "", f".env.example holds a usable {name}"
            else:
                assert op == ":-", f"{path.name}: ${name} has no `:-` default"
                assert documented[name] == value, f"{name}: compose default {value!r}, .env.example {documented[name]!r}"
    used = {name for name, _, _ in variables(COMPOSE.read_text() + COMPOSE_CPU.read_text())}
    assert set(documented) <= used, f"documented but unused: {set(documented) - used}"
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "PREFECT_AUTH_PASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD"} <= secrets
    # With the secrets set, the documented settings give the same stack as the defaults.
    only_secrets = {k: v for k, v in filled_env().items() if is_secret(k)}
    assert load_compose(env=filled_env()) == load_compose(env=only_secrets)


def test_compose_refuses_to_start_without_each_secret() -> None:
    """`docker compose up` without docker/.env, or with the example's empty values, or with one
    secret left out, stops and names the variable (compose's `:?`, as `interpolate` mirrors it)."""
    for env in ({}, env_example()):
        with pytest.raises(MissingVariable, match=re.escape("copy docker/.env.example to docker/.env")):
            load_compose(env=env)
    complete = filled_env()
    for name in (k for k in complete if is_secret(k)):
        for missing in ({k: v for k, v in complete.items() if k != name}, {**complete, name: ""}):
            with pytest.raises(MissingVariable, match=f"required variable {name} is missing a value"):
                load_compose(env=missing)


def test_secrets_stay_off_command_lines() -> None:
    """A command line is world-readable (`ps`, /proc/*/cmdline): secrets go in the environment."""
    env = filled_env()
    values = [v for k, v in env.items() if is_secret(k)]
    for path in (COMPOSE, COMPOSE_CPU):
        raw, compose = raw_compose(path)["services"], load_compose(path, env)["services"]
        for name in raw:
            for field in COMMAND_FIELDS:
                named = secrets_named(yaml.safe_dump(raw[name].get(field)))
                assert not named, f"{path.name}: {name}.{field} names {named}"
                expanded = yaml.safe_dump(compose[name].get(field))
                assert not [v for v in values if v in expanded], f"{path.name}: {name}.{field} holds a secret"
            # and each secret the container gets is one of docker/.env's, not a literal
            for key, value in environment(raw[name]).items():
                if is_secret(key):
                    assert any(is_secret(v[0]) and v[1] == ":?" for v in variables(value)), f"{name}: {key}={value}"


def test_credentials_stay_out_of_the_images_and_out_of_git() -> None:
    secret = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|TOKEN", re.IGNORECASE)
    for dockerfile in DOCKERFILES:
        for line in dockerfile.read_text().splitlines():
            if line.startswith(("ENV ", "ARG ")) or line.startswith(" "):
                assert not secret.search(line), f"{dockerfile.name}: {line}"
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=REPO).returncode
    example = subprocess.run(["git", "check-ignore", "-q", "docker/.env.example"], cwd=REPO).returncode
    assert ignored == 0, "docker/.env (real credentials) must be git-ignored"
    assert example == 1, "docker/.env.example (the documented settings) must not be ignored"


def test_both_servers_require_a_login_which_the_clients_have(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefect's basic auth and MLflow's basic-auth app are on, and init and the worker log in
    as the servers expect (tests/test_servers.py: strangers are refused, healthchecks are not)."""
    from mlflow.server.auth.config import read_auth_config

    prefect_auth = environment(services["prefect-server"])["PREFECT_SERVER_API_AUTH_STRING"]
    assert re.fullmatch(r"[^:]+:.{12,}", prefect_auth), "user:password"
    mlflow, env = services["mlflow"], environment(services["mlflow"])
    assert option(command_lines(mlflow)[0], "--app-name") == "basic-auth"
    assert "admin_password" not in mlflow_auth_config(mlflow), "a secret: MLFLOW_AUTH_ADMIN_PASSWORD"
    for key, value in {**env, "MLFLOW_AUTH_CONFIG_PATH": str(bind_mount(mlflow, env["MLFLOW_AUTH_CONFIG_PATH"]))}.items():
        monkeypatch.setenv(key, value)
    admin = read_auth_config()  # as the server resolves it: the file, then the environment
    assert admin.admin_password == env["MLFLOW_AUTH_ADMIN_PASSWORD"] != "password1234"
    assert len(admin.admin_password) >= 12 and env["MLFLOW_FLASK_SERVER_SECRET_KEY"]
    for client in ("init", "worker"):
        assert environment(services[client])["PREFECT_API_AUTH_STRING"] == prefect_auth, client
    worker = environment(services["worker"])
    login = (worker["MLFLOW_TRACKING_USERNAME"], worker["MLFLOW_TRACKING_PASSWORD"])
    assert login == (admin.admin_username, admin.admin_password)
    # The healthchecks send no credentials: the servers leave exactly those paths open.
    for name in ("prefect-server", "mlflow"):
        assert "Authorization" not in healthcheck_code(services[name]), name



def test_postgres_holds_the_databases_with_the_same_credentials(services: dict[str, dict[str, Any]]) -> None:
    pg = environment(services["postgres"])
    prefect_url = urlsplit(environment(services["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"])
    assert prefect_url.scheme == "postgresql+asyncpg"
    assert (prefect_url.username, prefect_url.password) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"])
    # MLflow's URIs (its store's on the command line, its users' in the auth config) hold no
    # credentials: libpq (psycopg) takes them from the environment.
    mlflow, mlflow_env = services["mlflow"], environment(services["mlflow"])
    mlflow_urls = [urlsplit(option(command_lines(mlflow)[0], "--backend-store-uri"))]
    mlflow_urls.append(urlsplit(mlflow_auth_config(mlflow)["database_uri"]))
    assert {(u.scheme, u.username, u.password) for u in mlflow_urls} == {("postgresql+psycopg", None, None)}
    assert (mlflow_env["PGUSER"], mlflow_env["PGPASSWORD"]) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"])
    urls = [prefect_url, *mlflow_urls]
    assert {u.netloc.rsplit("@", 1)[-1] for u in urls} == {"postgres:5432"}
    # one database each, all of them created on the first start
    assert sorted(u.path.lstrip("/") for u in urls) == sorted(pg["POSTGRES_MULTIPLE_DATABASES"].split(","))
    assert "POSTGRES_MULTIPLE_DATABASES" in (DOCKER / "initdb" / "create-databases.sh").read_text()


