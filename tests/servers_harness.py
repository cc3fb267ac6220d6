"""The server start/stop helpers of tests/test_servers.py: a throwaway PostgreSQL cluster, the
Prefect and MLflow servers (and the compose worker) as process groups on loopback, and how a
client reaches them, logged in as the compose worker is: the `rlhf` CLI, the Prefect REST API
and the Postgres tables behind it.

Skipping (or, with RLHF_REQUIRE_SERVERS=1, failing) when a server cannot run is `unavailable`.
"""

from __future__ import annotations

import base64
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.pipeline_fixtures import QUIET_ENV

REQUIRED = os.environ.get("RLHF_REQUIRE_SERVERS") == "1"
BIN = Path(sys.executable).parent
PG_USER, PG_PASSWORD = "rlhf", "rlhf-test-pw"
START_TIMEOUT = 300.0  # first start migrates both databases: a minute or two on a loaded 2-core box
LOGIN_KEYS = ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
"""What a client of the compose stack logs in with (the worker's environment holds them)."""


def unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason} (RLHF_REQUIRE_SERVERS=1: the server test must run here)")
    pytest.skip(reason)


def postgres_bin() -> Path | None:
    """Debian keeps the server binaries in /usr/lib/postgresql/<version>/bin, off the PATH."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).resolve().parent if on_path else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replace_option(argv: list[str], name: str, value: str) -> list[str]:
    """argv with `--name X` / `--name=X` set to value (the option must be there)."""
    out, i, found = [], 0, False
    while i < len(argv):
        if argv[i] == name:
            out += [name, value]
            i, found = i + 2, True
            continue
        if argv[i].startswith(name + "="):
            out.append(f"{name}={value}")
            found = True
        else:
            out.append(argv[i])
        i += 1
    assert found, f"{name} not in {argv}"
    return out


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Postgres:
    """A throwaway cluster: its own folder, a free loopback port, password auth over TCP."""

    bindir: Path
    root: Path
    port: int
    as_owner: list[str]

    @property
    def data(self) -> Path:
        return self.root / "data"

    def run(self, *argv: str) -> None:
        result = subprocess.run([*self.as_owner, *argv], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{argv[0]}: {result.stdout}{result.stderr}{tail(self.root / 'postgres.log')}"

    def start(self) -> None:
        pwfile = self.root / "pwfile"
        pwfile.write_text(PG_PASSWORD + "\n")
        self._chown(self.root, pwfile)
        self.run(
            str(self.bindir / "initdb"), "-D", str(self.data), "-U", PG_USER, f"--pwfile={pwfile}",
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C",
        )
        pwfile.unlink()
        options = f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root}"
        self.run(
            str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "postgres.log"),
            "-o", options, "-w", "-t", "120", "start",
        )

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run(
                [*self.as_owner, str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                capture_output=True, timeout=60,
            )

    def _chown(self, *paths: Path) -> None:
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            for path in paths:
                os.chown(path, owner.pw_uid, owner.pw_gid)


@dataclass
class Stack:
    """The servers, their URLs and logs, and how to reach them from a client process."""

    root: Path
    pg: Postgres
    compose: dict[str, Any]
    prefect_url: str = ""
    mlflow_url: str = ""
    artifacts: Path = field(default_factory=Path)
    logins: dict[str, str] = field(default_factory=dict)
    """LOGIN_KEYS: PREFECT_API_AUTH_STRING (user:password), MLFLOW_TRACKING_USERNAME/PASSWORD."""
    processes: list[tuple[str, subprocess.Popen, Path]] = field(default_factory=list)

    def client_env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
        env.update(QUIET_ENV)
        env.update(self.logins)
        env.update(
            PREFECT_API_URL=self.prefect_url,
            MLFLOW_TRACKING_URI=self.mlflow_url,
            PREFECT_HOME=str(self.root / "client-prefect-home"),
            RLHF_TINY_DIR=str(self.root / "tiny-models"),
            PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        )
        env.update(extra)
        return env

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """A server in its own process group, so its workers stop with it."""
        log = self.root / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(BIN / argv[0]), *argv[1:]], env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.root,
            )
        self.processes.append((name, proc, log))
        return proc

    def wait_healthy(self, name: str, url: str, timeout: float = START_TIMEOUT, auth: tuple[str, str] | None = None) -> None:
        proc, log = next((p, lg) for n, p, lg in self.processes if n == name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n{tail(log)}")
            try:
                if httpx.get(url, timeout=5, auth=auth).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        pytest.fail(f"{name} not healthy at {url} after {timeout:.0f}s:\n{tail(log)}")

    def stop_all(self) -> None:
        for _, proc, _ in reversed(self.processes):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in reversed(self.processes):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            # children that outlived their leader (uvicorn/gunicorn workers) share its group
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def run_cli(stack: Stack, *args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """`rlhf ARGS` (the installed script) as a user runs it against the servers."""
    result = subprocess.run(
        [str(BIN / "rlhf"), *args], cwd=cwd, env=stack.client_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"rlhf {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    return result


def basic_auth(login: str | None) -> dict[str, str]:
    """The header of HTTP basic auth for `user:password` (none for None)."""
    return {"Authorization": "Basic " + base64.b64encode(login.encode()).decode()} if login else {}


def status_of(method: str, url: str, login: str | None) -> int:
    """The HTTP status a request (POSTs: an empty JSON body) gets with this login or none."""
    body = {"json": {}} if method == "POST" else {}
    return httpx.request(method, url, headers=basic_auth(login), timeout=30, **body).status_code


def prefect_api(stack: Stack, method: str, path: str, **kwargs: Any) -> Any:
    headers = basic_auth(stack.logins["PREFECT_API_AUTH_STRING"])
    response = httpx.request(method, f"{stack.prefect_url}{path}", headers=headers, timeout=30, **kwargs)
    response.raise_for_status()
    return response.json()


def task_runs(stack: Stack, flow_run_id: str) -> list[dict[str, Any]]:
    return prefect_api(
        stack, "POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200}
    )


def stage_of(task_run: dict[str, Any]) -> str:
    """Prefect names a task run `<task name>-<suffix>`."""
    return task_run["name"].rsplit("-", 1)[0]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, logs: list[Path]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(2)
    pytest.fail(f"{what} after {timeout:.0f}s\n" + "\n".join(f"--- {p.name}\n{tail(p)}" for p in logs))


def query(stack: Stack, database: str, sql: str, *params: Any) -> list[tuple]:
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=stack.pg.port, user=PG_USER, password=PG_PASSWORD, dbname=database
    ) as conn, conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()

