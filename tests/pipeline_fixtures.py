"""Session fixtures of the end-to-end pipeline tests: real Prefect engine, real MLflow.

One temporary Prefect server serves the whole session (`prefect_test_harness`). Each pipeline
scenario runs once, in its own folder (mlflow.db, mlruns/ and .rlhf/ land there), and several
tests assert on what it left behind. The scenarios chain so that they always run in the same
order whichever test asks first:

    folder "main":   first run -> identical rerun -> force train_reward_model -> new PPO lr
                     -> an uninterrupted 3-round run (reference/preferences/RM come from the cache)
    folder "resume": a 3-round run that crashes after round 2's first iteration -> rerun

Registered by `pytest_plugins` in the test modules, so every fixture exists once per session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flows.runtime import DEFAULTS

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"
PPO_STAGES = ("ppo_round_1", "ppo_round_2")
UPSTREAM = ("snapshot_reference", "collect_preferences", "train_reward_model")
THREE_ROUNDS = ["ppo.rounds=3"]
FAIL_AT = "ppo_round:2:1"
NEW_LR = "ppo.algo.learning_rate=0.0005"

QUIET_ENV = {
    **DEFAULTS,  # the product's own offline/quiet defaults
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}


@dataclass
class Run:
    """One call of the flow: its result (None when it failed), error and wall time."""

    folder: Path
    overrides: list[str]
    result: dict[str, Any] | None
    seconds: float
    error: BaseException | None = None
    flow_run_id: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def stages(self) -> dict[str, str]:
        assert self.result is not None, f"the run failed: {self.error!r}"
        return self.result["stages"]

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{(self.folder / 'mlflow.db').as_posix()}"


def load_cfg(overrides: list[str] | None = None):
    from flows.config import load_config

    return load_config(TINY_CONFIG, overrides or [])


def run_pipeline(
    folder: Path,
    overrides: list[str] | None = None,
    force: list[str] | None = None,
    fail_at: str | None = None,
) -> Run:
    """Call the flow in-process with `folder` as the working directory."""
    from flows.pipeline import rlhf_pipeline

    overrides = overrides or []
    folder.mkdir(parents=True, exist_ok=True)
    cfg = load_cfg(overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        if fail_at:
            mp.setenv("RLHF_FAIL_AT", fail_at)
        else:
            mp.delenv("RLHF_FAIL_AT", raising=False)
        start = time.perf_counter()
        state = rlhf_pipeline(config=cfg.model_dump(mode="json"), force=force, return_state=True)
        seconds = time.perf_counter() - start
    flow_run_id = str(state.state_details.flow_run_id)
    if state.is_completed():
        return Run(folder, overrides, state.result(), seconds, flow_run_id=flow_run_id)
    return Run(
        folder,
        overrides,
        None,
        seconds,
        error=state.result(raise_on_failure=False),
        flow_run_id=flow_run_id,
    )


def stage_table_rows(folder: Path, overrides: list[str] | None = None) -> dict[str, dict[str, str]]:
    """`rlhf stages` in-process: stage label -> {key, status}."""
    from flows.stage_status import stage_table

    cfg = load_cfg(overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        return {row["stage"]: row for row in stage_table(cfg)}


def stage_status(folder: Path, overrides: list[str] | None = None) -> dict[str, str]:
    return {stage: row["status"] for stage, row in stage_table_rows(folder, overrides).items()}


def stage_folders(folder: Path) -> set[str]:
    """stage/key folders the stages have written outputs to."""
    root = folder / ".rlhf" / "tiny" / "stages"
    return {p.relative_to(root).as_posix() for p in root.glob("*/*")}


def stage_child_runs(run: Run, stage: str) -> list[Any]:
    """The MLflow child runs that computed (not replayed from the cache) `stage` in this flow run."""
    from mlflow import MlflowClient

    client = MlflowClient(run.tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(
        experiments,
        filter_string=(
            f"tags.`rlhf.stage` = '{stage}' and tags.`rlhf.cached` = 'false' "
            f"and tags.`prefect.flow_run_id` = '{run.flow_run_id}'"
        ),
    )


def metric_steps(run: Run, stage: str, metric: str = "objective/kl") -> list[int]:
    """Steps of `metric` in the child run of `stage` in this flow run."""
    from mlflow import MlflowClient

    children = stage_child_runs(run, stage)
    assert len(children) == 1, f"{stage}: {len(children)} child runs in flow run {run.flow_run_id}"
    history = MlflowClient(run.tracking_uri).get_metric_history(children[0].info.run_id, metric)
    return sorted(m.step for m in history)


def checkpoint_iterations(state_dir: Path) -> list[int]:
    """Iterations of the complete in-round checkpoints under a round's state folder."""
    return sorted(
        json.loads(p.read_text())["iteration"] for p in state_dir.glob("iter-*/trainer.json")
    )


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python -m flows.cli ARGS` in a fresh process (the CLI itself is under test)."""
    full_env = {**os.environ, **QUIET_ENV, **(env or {})}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    full_env.pop("RLHF_FAIL_AT", None)
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def pipeline_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Quiet offline defaults, tiny models in a session folder, one temporary Prefect server."""
    tiny_dir = tmp_path_factory.mktemp("tiny-models")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in QUIET_ENV.items():
            mp.setenv(key, value)
        mp.setenv("RLHF_TINY_DIR", str(tiny_dir))
        mp.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-home")))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("RLHF_FAIL_AT", raising=False)
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=None):
            yield tiny_dir


@pytest.fixture(scope="session")
def main_folder(pipeline_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("main")


NAMES = ("tiny-reward-model", "tiny-reference", "tiny-policy")
"""The models configs/tiny.yaml registers."""


def registry_snapshot(uri: str) -> dict[str, dict[str, Any]]:
    """name -> {versions, aliases, tags per version}, as it is now."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    out: dict[str, dict[str, Any]] = {}
    for rm in client.search_registered_models():
        versions = client.search_model_versions(f"name = '{rm.name}'")
        out[rm.name] = {
            "versions": sorted((str(v.version) for v in versions), key=int),
            "aliases": {alias: str(v) for alias, v in (rm.aliases or {}).items()},
            "tags": {str(v.version): dict(v.tags) for v in versions},
        }
    return out


@pytest.fixture(scope="session")
def first_run(main_folder: Path) -> Run:
    """The tiny pipeline from scratch (rounds 2 x 2 iterations)."""
    run = run_pipeline(main_folder)
    assert run.result is not None, f"first run failed: {run.error!r}"
    run.notes["stage_folders"] = stage_folders(main_folder)
    run.notes["summary"] = (main_folder / ".rlhf" / "tiny" / "last_summary.md").read_text()
    run.notes["registry"] = registry_snapshot(run.tracking_uri)
    run.notes["stages_after"] = stage_status(main_folder)
    run.notes["stages_new_lr"] = stage_status(main_folder, [NEW_LR])
    run.notes["stages_new_rm"] = stage_status(main_folder, ["reward_model.learning_rate=0.002"])
    return run


@pytest.fixture(scope="session")
def second_run(first_run: Run) -> Run:
    """The same config again, in the same folder."""
    run = run_pipeline(first_run.folder)
    run.notes["stage_folders"] = stage_folders(first_run.folder)
    run.notes["registry"] = registry_snapshot(run.tracking_uri)
    return run


@pytest.fixture(scope="session")
def forced_run(second_run: Run) -> Run:
    """--force train_reward_model."""
    run = run_pipeline(second_run.folder, force=["train_reward_model"])
    if run.result is not None:
        run.notes["round_steps"] = {s: metric_steps(run, s) for s in PPO_STAGES}
    return run


@pytest.fixture(scope="session")
def new_lr_run(forced_run: Run) -> Run:
    """A changed PPO learning rate."""
    return run_pipeline(forced_run.folder, [NEW_LR])


@pytest.fixture(scope="session")
def uninterrupted_three_rounds(new_lr_run: Run) -> Run:
    """3 rounds without a crash; the upstream stages come from the main folder's cache."""
    return run_pipeline(new_lr_run.folder, THREE_ROUNDS)


@pytest.fixture(scope="session")
def best_round_run(uninterrupted_three_rounds: Run) -> Run:
    """The 3-round run again with `promote: best_round` and a KL budget that the last round
    overran but an earlier one did not: only evaluation reruns, and it promotes an earlier round."""
    before = json.loads(Path(uninterrupted_three_rounds.result["report_path"]).read_text())
    kls = {int(k): e["kl_exact"] for k, e in before["rounds"].items()}
    earlier = [kl for k, kl in kls.items() if k < 3 and kl < kls[3]]
    assert earlier, f"no tiny round before the last had a lower KL: {kls}"
    budget = (max(earlier) + kls[3]) / 2
    overrides = [*THREE_ROUNDS, "evaluation.gates.promote=best_round", f"evaluation.gates.max_kl={budget}"]
    run = run_pipeline(uninterrupted_three_rounds.folder, overrides)
    run.notes["budget"] = budget
    run.notes["registry"] = registry_snapshot(run.tracking_uri)
    return run


@pytest.fixture(scope="session")
def crashed_run(pipeline_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """3 rounds, crashing right after round 2's first iteration was checkpointed."""
    folder = tmp_path_factory.mktemp("resume")
    run = run_pipeline(folder, THREE_ROUNDS, fail_at=FAIL_AT)
    table = stage_table_rows(folder, THREE_ROUNDS)
    run.notes["stages_before_rerun"] = {stage: row["status"] for stage, row in table.items()}
    state_dir = (
        folder / ".rlhf" / "tiny" / "stages" / "ppo_round" / table["ppo_round_2"]["key"] / "state"
    )
    run.notes["round_2_state_dir"] = state_dir
    run.notes["round_2_checkpoints"] = (
        checkpoint_iterations(state_dir) if state_dir.is_dir() else None
    )
    run.notes["round_2_steps"] = metric_steps(run, "ppo_round_2")
    return run


@pytest.fixture(scope="session")
def resumed_run(crashed_run: Run) -> Run:
    """The same 3-round config again, without the fault hook."""
    run = run_pipeline(crashed_run.folder, THREE_ROUNDS)
    if run.result is not None:
        run.notes["round_2_steps"] = metric_steps(run, "ppo_round_2")
    return run


@pytest.fixture(scope="session")
def damaged_run(pipeline_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A finished tiny run whose outputs are then damaged behind the cache's back: the reward
    model's weights truncated, the last round's exported policy deleted. Then the same run again."""
    folder = tmp_path_factory.mktemp("damaged")
    intact = run_pipeline(folder)
    assert intact.result is not None, f"first run failed: {intact.error!r}"
    rm_weights = next((folder / ".rlhf" / "tiny" / "stages" / "train_reward_model").glob("*/model/*.safetensors"))
    rm_weights.write_bytes(rm_weights.read_bytes()[:1000])
    policy = Path(intact.result["policy_path"])
    for item in policy.iterdir():
        item.unlink()
    policy.rmdir()
    run = run_pipeline(folder)
    run.notes["intact"] = intact
    run.notes["damaged"] = {"rm_weights": rm_weights, "policy": policy}
    return run


class _Payload:
    """Unpickling this creates a folder: the stand-in for code an attacker would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


@pytest.fixture(scope="session")
def tampered_run(damaged_run: Run) -> Run:
    """The damaged folder's evaluate record replaced by a pickle record (Prefect's default
    format) whose unpickling would run code; then `rlhf stages` and the same run again."""
    from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
    from prefect.serializers import PickleSerializer

    folder = damaged_run.folder
    table = stage_table_rows(folder)
    record = folder / ".rlhf" / "tiny" / "results" / table["evaluate"]["key"]
    marker = folder / "payload-ran"
    evil = ResultRecord(metadata=ResultRecordMetadata(serializer=PickleSerializer()), result=_Payload(marker))
    run_notes = {"record": record, "marker": marker, "honest_record": json.loads(record.read_bytes())}
    record.write_bytes(evil.serialize())
    run_notes["stages_with_tampered_record"] = stage_status(folder)
    run = run_pipeline(folder)
    run.notes.update(run_notes)
    return run
