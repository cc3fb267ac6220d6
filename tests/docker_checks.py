"""The compose/Dockerfile parsing helpers of tests/test_docker.py, shared with
tests/test_servers.py: where docker/ lives, the compose files loaded as `docker compose config`
would see them, the argv of each service command, and the installed CLIs' command parsers that
resolve them (prefect, mlflow, rlhf, ray).
"""

from __future__ import annotations

import ast
import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_CPU = DOCKER / "compose.cpu.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
DOCKERFILES = (DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda")
SERVICES = {"postgres", "prefect-server", "minio", "mlflow", "init", "worker", "ray-head", "ray-worker"}
OUR_IMAGES = {"prefect-server", "mlflow", "init", "worker", "ray-head", "ray-worker"}
"""Services that run the project image: their commands must exist in the installed CLIs."""
ONE_SHOT = {"init"}

# `$$` (a literal dollar), ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $VAR.
TOKEN = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")
# A variable the shell inside a container expands ($$VAR in compose text): its value would be
# on the command line of whatever the shell runs.
SHELL_VARIABLE = re.compile(r"\$\$\{?([A-Za-z_]\w*)")
SECRET = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH_STRING")
"""Names of variables (docker/.env's and the containers') that hold a secret."""
# Where a container's command line comes from: what `ps` shows.
COMMAND_FIELDS = ("command", "entrypoint", "healthcheck")


def is_secret(name: str) -> bool:
    return bool(SECRET.search(name))


def variables(text: str) -> list[tuple[str, str, str]]:
    """(name, operator, default or error message) of every substitution in compose text; ""
    for $VAR."""
    return [(m[1] or m[4], m[2] or "", m[3] or "") for m in TOKEN.finditer(text) if m[0] != "$$"]


def secrets_named(text: str) -> list[str]:
    """The secret variables compose text refers to, for compose or for a shell in a container."""
    return [n for n in [v[0] for v in variables(text)] + SHELL_VARIABLE.findall(text) if is_secret(n)]


class MissingVariable(KeyError):
    """What compose refuses to start with: a `${VAR:?message}` without a value."""


class Reset:
    """Compose's `!reset` tag (an override file removing a key); PyYAML does not know it."""


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: the value from `env`; else the `-` default, or the
    `?` error (with `:`, an empty value counts as unset)."""

    def sub(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name, op, default = match[1] or match[4], match[2] or "", match[3]
        value = env.get(name)
        if value or (value is not None and not op.startswith(":")):
            return value
        if op.endswith("-"):
            return default
        if op.endswith("?"):
            raise MissingVariable(f"required variable {name} is missing a value: {default}")
        raise KeyError(f"${{{name}}} has no value and no default")

    return TOKEN.sub(sub, text)


def load_compose(path: Path = COMPOSE, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file as `docker compose config` would see it with `env` (default: the
    documented settings with a stand-in for every secret, see `filled_env`)."""
    return yaml.load(interpolate(path.read_text(), filled_env() if env is None else env), Loader=ComposeLoader)


def raw_compose(path: Path = COMPOSE) -> dict[str, Any]:
    """The compose file before variable substitution."""
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def filled_env(**values: str) -> dict[str, str]:
    """A docker/.env made from the example as its comments say: every secret set (unless given,
    to a distinct stand-in long enough for MLflow's 12-character rule), the settings as
    documented."""
    env = env_example()
    for name, value in env.items():
        if is_secret(name) and not value:
            env[name] = f"{name.lower().replace('_', '-')}-0123456789abcdef"
    env.update(values)
    return env


def bind_mount(service: dict[str, Any], target: str) -> Path:
    """The host file or folder (under docker/) a service mounts at `target`."""
    for volume in service.get("volumes", []):
        source, mounted = volume.split(":")[:2]
        if mounted == target:
            return (DOCKER / source).resolve()
    raise AssertionError(f"nothing is mounted at {target}: {service.get('volumes')}")


def command_lines(service: dict[str, Any]) -> list[list[str]]:
    """The argv of each command a service runs: its `command`, or each line of an `sh -c`
    script."""
    command = service.get("command")
    if command is None:
        return []
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if argv[0] == "sh" and argv[1].startswith("-") and "c" in argv[1]:
        return [shlex.split(line) for line in argv[2].splitlines() if line.strip() and not line.startswith("#")]
    return [argv]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def mlflow_auth_config(mlflow: dict[str, Any]) -> dict[str, str]:
    """The [mlflow] section of the auth config file the MLflow service is given."""
    parser = configparser.ConfigParser()
    parser.read_string(bind_mount(mlflow, environment(mlflow)["MLFLOW_AUTH_CONFIG_PATH"]).read_text())
    return dict(parser["mlflow"])


def option(argv: list[str], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in argv."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def healthcheck_code(service: dict[str, Any]) -> str | None:
    test = service.get("healthcheck", {}).get("test") or []
    if test[:3] == ["CMD", "python", "-c"]:
        return test[3]
    return None


# --- command parsers of the installed CLIs: a wrong subcommand or option raises -----------


def parse_prefect(args: list[str]) -> None:
    from prefect.cli._app import _app  # the cyclopts app behind the `prefect` script

    command, _, _ = _app.parse_args(args, exit_on_error=False, print_error=False)
    # a group without its subcommand resolves to the group's help printer
    assert command.__module__.startswith("prefect.cli"), f"prefect {shlex.join(args)}: not a command"


def parse_click(group: Any, prog: str, args: list[str]) -> None:
    """Walk a click group (mlflow's; typer's vendored click for rlhf) down to the command and
    let it parse the rest; any usage error becomes an AssertionError naming the command."""
    command, rest = group, list(args)
    while hasattr(command, "list_commands"):  # a group
        assert rest, f"{prog}: a subcommand is missing"
        name, *rest = rest
        sub = command.get_command(command.context_class(command), name)
        assert sub is not None, f"{prog}: no subcommand {name!r}"
        prog, command = f"{prog} {name}", sub
    try:
        command.make_context(prog, rest)  # parses and validates options, runs nothing
    except Exception as err:
        raise AssertionError(f"{prog} {shlex.join(rest)}: {type(err).__name__}: {err}") from err


def parse_mlflow(args: list[str]) -> None:
    from mlflow.cli import cli

    parse_click(cli, "mlflow", args)


def parse_rlhf(args: list[str]) -> None:
    import typer

    from flows.cli import app

    parse_click(typer.main.get_command(app), "rlhf", args)


def parse_ray(args: list[str]) -> None:
    from ray.scripts.scripts import cli

    parse_click(cli, "ray", args)


def check_argv(argv: list[str]) -> None:
    """Resolve argv against the CLI it names (prefect, mlflow, rlhf, ray, python -c)."""
    program, args = argv[0], argv[1:]
    if program == "prefect":
        parse_prefect(args)
    elif program == "mlflow":
        parse_mlflow(args)
    elif program == "rlhf":
        parse_rlhf(args)
    elif program == "ray":
        parse_ray(args)
    elif program == "python" and args[:1] == ["-c"]:
        ast.parse(args[1])
    else:
        raise AssertionError(f"{argv}: not a CLI of the project image")


# ---- fixtures of the docker test modules (registered there with pytest_plugins) -----------
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """docker/compose.yaml as compose reads it with the documented settings."""
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]
