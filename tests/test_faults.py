"""Faults lose nothing: damaged outputs behind a cached stage are found and recomputed.

Runs the tiny pipeline with the real Prefect engine and MLflow (tests/pipeline_fixtures.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.pipeline_fixtures")

from tests.pipeline_fixtures import QUIET_ENV, TINY_CONFIG, Run  # noqa: E402

pytest_plugins = ["tests.pipeline_fixtures"]
pytestmark = pytest.mark.slow


def test_damaged_outputs_of_cached_stages_are_recomputed_to_the_same_result(damaged_run: Run) -> None:
    intact: Run = damaged_run.notes["intact"]
    assert damaged_run.result is not None, f"the rerun failed: {damaged_run.error!r}"
    # the RM and the last round rerun; every other stage, and what depends only on unchanged
    # hashes (round 1, evaluation), stays cached
    assert damaged_run.stages == {
        "snapshot_reference": "Cached",
        "collect_preferences": "Cached",
        "train_reward_model": "Completed",
        "ppo_round_1": "Cached",
        "ppo_round_2": "Completed",
        "evaluate": "Cached",
    }
    assert damaged_run.result["policy_sha256"] == intact.result["policy_sha256"]
    damaged = damaged_run.notes["damaged"]
    assert Path(damaged["policy"]).is_dir()
    assert Path(damaged["rm_weights"]).stat().st_size > 1000


def test_a_stage_reference_reports_what_changed_on_disk(tmp_path: Path) -> None:
    from flows.refs import PolicyCheckpoint, PreferenceSet
    from ppo_core.lm.checkpoint import sha256_file, sha256_tree

    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    prompts = tmp_path / "train.json"
    prompts.write_text("[]")
    prefs = PreferenceSet(path=str(data), sha256=sha256_file(data), n_rows=1, n_read=1,
                          train_prompts_path=str(prompts), heldout_prompts_path=str(prompts))
    assert prefs.problems() == []
    data.write_text("edited\n")
    assert prefs.problems() == [f"{data} has sha256 {sha256_file(data)[:12]}, recorded {prefs.sha256[:12]}"]
    prompts.unlink()
    assert f"{prompts} is missing" in prefs.problems()

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"weights")
    state = tmp_path / "state"
    state.mkdir()
    ckpt = PolicyCheckpoint(path=str(policy), sha256=sha256_tree(policy), round=1, iteration=2, state_path=str(state))
    assert ckpt.problems() == []
    state.rmdir()
    assert ckpt.problems() == [f"{state} is missing"]
    (policy / "model.safetensors").unlink()
    policy.rmdir()
    assert ckpt.problems()[0] == f"{policy} is missing"


def test_cache_records_are_json_and_a_tampered_record_is_never_executed(tampered_run: Run) -> None:
    notes = tampered_run.notes
    honest = notes["honest_record"]
    assert honest["metadata"]["serializer"]["type"] == "json"
    assert json.loads(honest["result"])["__class__"] == "flows.refs.EvalRef"
    # `rlhf stages` read the pickle record as absent, without unpickling it
    assert notes["stages_with_tampered_record"]["evaluate"] == "missing"
    assert notes["stages_with_tampered_record"]["ppo_round_2"] == "cached"
    # the run recomputed evaluation, wrote an honest record over the pickle, and ran no payload
    assert tampered_run.result is not None, f"the rerun failed: {tampered_run.error!r}"
    assert tampered_run.stages["evaluate"] == "Completed"
    assert tampered_run.stages["ppo_round_2"] == "Cached"
    assert json.loads(Path(notes["record"]).read_bytes())["metadata"]["serializer"]["type"] == "json"
    assert not Path(notes["marker"]).exists()


def test_record_check_refuses_foreign_serializers_and_classes() -> None:
    from flows.records import RECORD_SERIALIZER, UntrustedRecordError, check_record

    serializer = RECORD_SERIALIZER.model_dump(mode="json")

    def record(result: object, ser: object = serializer) -> bytes:
        return json.dumps({"metadata": {"serializer": ser}, "result": json.dumps(result)}).encode()

    ok = record({"__class__": "flows.refs.ReferenceRef", "data": {"path": "p", "sha256": "s"}})
    assert check_record(ok, "k") == ok
    assert check_record(record("a/path/labels.jsonl"), "k")  # the human-pairs stage returns a path
    for bad, reason in (
        (record({"__class__": "subprocess.Popen", "data": ["ls"]}), "subprocess.Popen"),
        (record([{"x": {"__exc_type__": "os.error", "message": "m"}}]), "os.error"),
        (record("x", {**serializer, "jsonlib": "pickle"}), "serializer 'json'"),
        (record("x", {"type": "pickle"}), "serializer 'pickle'"),
        (b"\x80\x04not json", "not a JSON result record"),
    ):
        with pytest.raises(UntrustedRecordError, match=reason.replace(".", r"\.")):
            check_record(bad, "k")


def _python(code: str, cwd: Path, **env: str) -> subprocess.Popen:
    full_env = {**os.environ, **QUIET_ENV, **env}
    return subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=full_env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rlhf_run(cwd: Path, timeout: float, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`rlhf run configs/tiny.yaml ARGS` as a job of its own (a process group, as from a shell)."""
    full_env = {**os.environ, **QUIET_ENV, **env}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(TINY_CONFIG), *args], cwd=cwd,
                            env=full_env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _shared_api() -> dict[str, str]:
    """The session's Prefect server for a CLI subprocess (it then starts no temporary one)."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value()}


def test_the_tracking_store_is_created_whole_even_when_killed_or_raced(tmp_path: Path) -> None:
    """A kill while MLflow builds a new sqlite store used to leave a half-migrated mlflow.db
    that failed every later run; two runs starting at once migrated it twice."""
    db = tmp_path / "mlflow.db"
    connect = f"from flows.tracking import connect; print(connect('sqlite:///{db}', 'exp'))"
    killed = _python(connect, tmp_path, RLHF_KILL_AT="tracking_store")
    assert killed.wait(timeout=120) == -signal.SIGKILL
    assert not db.exists() and list(tmp_path.glob(".mlflow.db.tmp-*"))  # it died after building the schema
    racers = [_python(connect, tmp_path) for _ in range(2)]
    outs = [(p.wait(timeout=120), *p.communicate()) for p in racers]
    assert [rc for rc, _, _ in outs] == [0, 0], outs
    assert outs[0][1].strip() == outs[1][1].strip()  # the same experiment id for both
    assert db.exists() and not list(tmp_path.glob(".mlflow.db.tmp-*"))


def test_a_second_run_in_the_same_work_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    from flows.locks import work_folder_lock

    work = tmp_path / ".rlhf" / "tiny"
    holder = _python(
        f"from flows.locks import work_folder_lock\nwith work_folder_lock({str(work)!r}):\n"
        "    print('held', flush=True)\n    import time; time.sleep(600)",
        tmp_path,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        second = _rlhf_run(tmp_path, timeout=120)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert [line for line in second.stderr.splitlines() if line.startswith("error:")] == [
            f"error: work folder {work} is in use by pid {holder.pid} on {socket.gethostname()} "
            f"since {json.loads((work / '.run.lock').read_text())['since']} ({json.loads((work / '.run.lock').read_text())['command']}); "
            "wait for that run to finish or set orchestration.work_dir"
        ]
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with work_folder_lock(work):  # the dead holder's lock is taken over
        assert json.loads((work / ".run.lock").read_text())["pid"] == os.getpid()


KILL_POINTS = (
    "register",  # the reference logged to MLflow, not yet registered
    "ppo_round_1:1",  # inside round 1, its first iteration done
    "after:ppo_round_1",  # between the rounds
    "evaluate",  # inside evaluation: the reference evaluated, no policy yet
)


def test_runs_killed_at_each_point_then_rerun_end_exactly_as_an_uninterrupted_run(
    pipeline_env: Path, first_run: Run, tmp_path: Path
) -> None:
    """SIGKILL of `rlhf run` (its process group) at each named point in turn, each time running
    the same command again, which resumes and is killed at the next point; the last rerun
    finishes with the uninterrupted run's policy (same sha256), one version per model content
    with its hash tag (a kill between logging and registering used to leave an untagged version
    and a twin), nothing of the killed runs left Running in Prefect or MLflow, and the
    unfinished files of a killed writer removed."""
    from mlflow import MlflowClient

    stderrs = []
    for point in KILL_POINTS:
        killed = _rlhf_run(tmp_path, 300, RLHF_KILL_AT=point, **_shared_api())
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-2000:])
        stderrs.append(killed.stderr)
    debris = tmp_path / ".rlhf" / "tiny" / "stages" / "ppo_round" / ".model.tmp-12345"  # as a killed export leaves it
    debris.mkdir(parents=True)
    rerun = _rlhf_run(tmp_path, 600, **_shared_api())
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"sha256 {first_run.result['policy_sha256']}" in rerun.stdout
    assert not debris.exists() and "removed 1 unfinished file(s) of a killed run: .model.tmp-12345" in rerun.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    versions = {rm.name: client.search_model_versions(f"name = '{rm.name}'") for rm in client.search_registered_models()}
    assert set(versions) == {"tiny-reference", "tiny-reward-model", "tiny-policy"}
    for name, found in versions.items():
        hashes = [mv.tags.get("rlhf.sha256") for mv in found]
        assert None not in hashes and len(hashes) == len(set(hashes)), (name, hashes)
    assert {name: len(found) for name, found in versions.items()} == {"tiny-reference": 1, "tiny-reward-model": 1, "tiny-policy": 1}
    # each killed run's leftovers were closed by the next run: its Prefect flow run, and the
    # MLflow run of the stage it was killed in, no longer claim to be running
    after_kill = [*stderrs[1:], rerun.stderr]
    assert all("marked Crashed" in err for err in after_kill)
    assert "MLflow run(s) marked FAILED (snapshot_reference)" in after_kill[0]
    assert "MLflow run(s) marked FAILED (ppo_round_1)" in after_kill[1]
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments, filter_string="attributes.status = 'RUNNING'") == []


def test_a_failed_stage_is_one_error_line_naming_the_log_and_debug_shows_the_traceback(
    pipeline_env: Path, tmp_path: Path
) -> None:
    failed = _rlhf_run(tmp_path, 300, RLHF_FAIL_AT="ppo_round:1:1", **_shared_api())
    assert failed.returncode == 1
    lines = failed.stderr.splitlines()
    errors = [line for line in lines if line.startswith(("error:", "details:"))]
    message = "RLHF_FAIL_AT=ppo_round:1:1: injected failure in ppo_round round 1 after iteration 1"
    assert errors[0] == f"error: ppo_round_1 failed: InjectedFailure: {message}", errors
    log = Path(errors[1].removeprefix("details: ").removesuffix(" (or run again with --debug)"))
    assert errors[1:] == [f"details: {log} (or run again with --debug)"]
    assert "Traceback" not in failed.stderr and sum(message in line for line in lines) == 1
    text = log.read_text()
    assert "Traceback" in text and "raise InjectedFailure" in text
    assert "task run 'collect_preferences" in text and "preference set: 24 pairs" in text  # INFO records, named
    # the Prefect UI has the stages' INFO records and the library's (ppo_core's loggers)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import LogSort

    with get_client(sync_client=True) as client:
        shown = [(r.name, r.message) for r in client.read_logs(limit=200, sort=LogSort.TIMESTAMP_DESC)]
    assert any(name == "ppo_core.lm.checkpoint" and str(tmp_path) in msg for name, msg in shown), shown[:20]
    assert any(name == "prefect.task_runs" and msg.startswith("preference set: 24 pairs") for name, msg in shown)
    debug = _rlhf_run(tmp_path, 300, "--debug", RLHF_FAIL_AT="ppo_round:2:1", **_shared_api())
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "raise InjectedFailure" in debug.stderr
