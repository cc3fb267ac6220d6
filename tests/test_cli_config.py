"""Config errors through the `rlhf` CLI (a real subprocess): one `field.path: reason` line per
problem, exit code 2, no traceback, before prefect, mlflow or any model is touched; `${ENV}`
interpolation and `--set` overrides.

All invocations start together (a thread pool) in one module fixture: each is a fresh Python
that imports torch, so running them side by side keeps the module to a few seconds of wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytest.register_assert_rewrite("tests.pipeline_fixtures")

from tests.pipeline_fixtures import QUIET_ENV, TINY_CONFIG  # noqa: E402

TRACKED = ("prefect", "mlflow")
"""Packages the CLI must not import before the config is valid."""


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    imported: set[str]
    seconds: float
    tiny_dir: Path

    @property
    def errors(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def _imported_top_level(importtime_stderr: str) -> set[str]:
    """Top-level packages named in `python -X importtime` lines."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def _cli(args: list[str], cwd: Path, env: dict[str, str]) -> CliResult:
    full_env = {**os.environ, **QUIET_ENV, **env}
    for name in ("MLFLOW_TRACKING_URI", "RLHF_FAIL_AT", "RLHF_TEST_NAME", "RLHF_TEST_ROUNDS"):
        if name not in env:
            full_env.pop(name, None)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flows.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.perf_counter() - start
    stderr = "\n".join(
        line for line in proc.stderr.splitlines() if not line.startswith("import time:")
    )
    return CliResult(
        proc.returncode,
        proc.stdout,
        stderr,
        _imported_top_level(proc.stderr),
        seconds,
        Path(env["RLHF_TINY_DIR"]),
    )


@pytest.fixture(scope="module")
def env_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny.yaml with `${ENV}` references (and its prompt file as an absolute path)."""
    raw = yaml.safe_load(TINY_CONFIG.read_text())
    raw["name"] = "${RLHF_TEST_NAME}"
    raw["ppo"]["rounds"] = "${RLHF_TEST_ROUNDS:-3}"
    raw["prompts"]["source"] = str((TINY_CONFIG.parent / raw["prompts"]["source"]).resolve())
    path = tmp_path_factory.mktemp("env-config") / "env.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def unknown_key_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = yaml.safe_load(TINY_CONFIG.read_text())
    raw["ppo"]["algo"]["learnig_rate"] = 0.1
    path = tmp_path_factory.mktemp("typo-config") / "typo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def cli(
    tmp_path_factory: pytest.TempPathFactory, env_config: Path, unknown_key_config: Path
) -> dict[str, CliResult]:
    tiny = str(TINY_CONFIG)
    cases: dict[str, tuple[list[str], dict[str, str]]] = {
        "unknown_key_file": (["validate", str(unknown_key_config)], {}),
        "two_bad_values": (
            ["validate", tiny, "--set", "ppo.rounds=0", "--set", "evaluation.n_prompts=abc"],
            {},
        ),
        "missing_files": (
            [
                "validate",
                tiny,
                "--set",
                "prompts.source=./nope.txt",
                "--set",
                "model.source=./no_such_model_dir",
            ],
            {},
        ),
        "env_ok": (
            ["validate", str(env_config), "--set", "ppo.iterations_per_round=7"],
            {"RLHF_TEST_NAME": "envpipe"},
        ),
        "run_bad_value": (["run", tiny, "--set", "ppo.algo.learning_rate=-1"], {}),
    }
    jobs = {}
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        for name, (args, env) in cases.items():
            cwd = tmp_path_factory.mktemp(name)
            env = {"RLHF_TINY_DIR": str(cwd / "tiny-models"), **env}
            jobs[name] = pool.submit(_cli, args, cwd, env)
        return {name: job.result() for name, job in jobs.items()}


def assert_config_error(result: CliResult, *expected_prefixes: str) -> None:
    """Exit 2, one `error: path: reason` line per problem, no traceback, nothing heavy imported."""
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    assert len(result.errors) == len(expected_prefixes), result.stderr[-2000:]
    for prefix in expected_prefixes:
        assert any(line.startswith(f"error: {prefix}") for line in result.errors), (
            prefix,
            result.errors,
        )
    assert not result.imported & set(TRACKED), result.imported & set(TRACKED)


def test_unknown_key_in_the_file(cli: dict[str, CliResult]) -> None:
    assert_config_error(
        cli["unknown_key_file"], "ppo.algo.learnig_rate: Extra inputs are not permitted"
    )
    assert not cli[
        "unknown_key_file"
    ].tiny_dir.exists()  # failed before any model source was resolved


def test_bad_values_each_get_their_own_line(cli: dict[str, CliResult]) -> None:
    result = cli["two_bad_values"]
    assert_config_error(
        result,
        "ppo.rounds: Input should be greater than or equal to 1",
        "evaluation.n_prompts: Input should be a valid integer",
    )
    assert not result.tiny_dir.exists()


def test_missing_files_are_reported_with_their_field(cli: dict[str, CliResult]) -> None:
    result = cli["missing_files"]
    assert_config_error(result, "prompts.source:", "model.source:")
    (prompts,) = [line for line in result.errors if line.startswith("error: prompts.source:")]
    (model,) = [line for line in result.errors if line.startswith("error: model.source:")]
    assert "nope.txt" in prompts and "not found" in prompts
    assert "no_such_model_dir" in model


def test_env_interpolation_and_set_override(cli: dict[str, CliResult]) -> None:
    ok = cli["env_ok"]
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (
        "pipeline 'envpipe', 3 PPO rounds x 7 iterations" in ok.stdout
    )  # ${VAR}, ${VAR:-default}, --set


def test_run_reports_config_errors_before_starting_anything(cli: dict[str, CliResult]) -> None:
    result = cli["run_bad_value"]
    assert_config_error(result, "ppo.algo.learning_rate: Input should be greater than 0")
    assert not (result.tiny_dir.parent / ".rlhf").exists()  # no Prefect home, no work folder


def test_config_errors_come_back_fast(cli: dict[str, CliResult]) -> None:
    """One Python start plus torch's import each (run side by side here), well under a minute."""
    slowest = max(cli.values(), key=lambda r: r.seconds)
    assert slowest.seconds < 90, {name: round(r.seconds, 1) for name, r in cli.items()}


# --- the same CLI in-process (typer's runner): cheaper for the remaining cases ----------------


@pytest.fixture
def invoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from typer.testing import CliRunner

    from flows.cli import app
    from flows.runtime import DEFAULTS

    monkeypatch.chdir(tmp_path)
    # flows.runtime.configure_environment only fills unset variables: set them all here so that
    # nothing it writes outlives the test.
    for name, value in {**DEFAULTS, "PREFECT_HOME": str(tmp_path / "prefect-home")}.items():
        monkeypatch.setenv(name, os.environ.get(name, value) if name != "PREFECT_HOME" else value)
    monkeypatch.setenv("RLHF_TINY_DIR", str(tmp_path / "tiny-models"))
    for name in ("RLHF_TEST_NAME", "RLHF_TEST_ROUNDS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str):
        result = CliRunner().invoke(app, list(args))
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            result.exception
        )
        return result

    return run


def in_process_errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_unknown_key_from_set(invoke) -> None:
    result = invoke("validate", str(TINY_CONFIG), "--set", "reward_model.lr=0.1")
    assert result.exit_code == 2
    assert in_process_errors(result) == ["error: reward_model.lr: Extra inputs are not permitted"]


def test_missing_config_file(invoke) -> None:
    result = invoke("validate", "no-such-config.yaml")
    assert result.exit_code == 2
    assert in_process_errors(result) == ["error: no-such-config.yaml: config file not found"]


def test_env_default_is_overridden_by_the_environment(
    invoke, env_config: Path, monkeypatch
) -> None:
    monkeypatch.setenv("RLHF_TEST_NAME", "envpipe")
    monkeypatch.setenv("RLHF_TEST_ROUNDS", "5")
    result = invoke("validate", str(env_config))
    assert result.exit_code == 0, result.stderr
    assert "pipeline 'envpipe', 5 PPO rounds x 2 iterations" in result.stdout


def test_missing_environment_variable_names_the_field(invoke, env_config: Path) -> None:
    result = invoke("validate", str(env_config))
    assert result.exit_code == 2
    assert in_process_errors(result) == [
        "error: name: environment variable RLHF_TEST_NAME is not set"
    ]


def test_set_override_names_a_bad_value(invoke) -> None:
    result = invoke("validate", str(TINY_CONFIG), "--set", "tracking.register_models=maybe")
    assert result.exit_code == 2
    assert in_process_errors(result) == [
        "error: tracking.register_models: Input should be a valid boolean, unable to interpret input"
    ]


def test_run_rejects_an_unknown_forced_stage(invoke, tmp_path: Path) -> None:
    result = invoke("run", str(TINY_CONFIG), "--force", "nope")
    assert result.exit_code == 2
    (line,) = in_process_errors(result)
    assert line.startswith("error: --force: unknown stage(s) ['nope']")
    assert "train_reward_model" in line  # the message lists the valid stages
    assert not (tmp_path / ".rlhf" / "tiny").exists()  # the flow never started


def test_run_reports_an_unusable_work_folder_in_one_line_before_prefect(invoke, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    work = blocker / "work"
    start = time.perf_counter()
    result = invoke("run", str(TINY_CONFIG), "--set", f"orchestration.work_dir={work}")
    assert result.exit_code == 2 and time.perf_counter() - start < 15
    assert in_process_errors(result) == [
        f"error: orchestration.work_dir: {work} is not a writable folder (Not a directory)"
    ]
    assert not (tmp_path / "prefect-home").exists()  # Prefect never started
