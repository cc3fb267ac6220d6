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


def _rlhf_run(cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """`rlhf run configs/tiny.yaml` as a job of its own (a process group, as from a shell)."""
    full_env = {**os.environ, **QUIET_ENV, **env}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(TINY_CONFIG)], cwd=cwd, env=full_env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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


def test_a_kill_during_registration_leaves_one_tagged_version_per_model(pipeline_env: Path, tmp_path: Path) -> None:
    """SIGKILL of `rlhf run` (its process group) between logging the reference and registering
    it, then the same command again: it finishes, every registered model has exactly one version
    per content hash, each carrying its hash (before, an untagged version made the rerun register
    a twin), and nothing of the killed run is left Running in Prefect or MLflow."""
    from mlflow import MlflowClient

    killed = _rlhf_run(tmp_path, timeout=300, RLHF_KILL_AT="register")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    rerun = _rlhf_run(tmp_path, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    versions = {rm.name: client.search_model_versions(f"name = '{rm.name}'") for rm in client.search_registered_models()}
    assert set(versions) == {"tiny-reference", "tiny-reward-model", "tiny-policy"}
    for name, found in versions.items():
        hashes = [mv.tags.get("rlhf.sha256") for mv in found]
        assert None not in hashes and len(hashes) == len(set(hashes)), (name, hashes)
    assert len(versions["tiny-reference"]) == 1
    # the killed run's leftovers were closed by the rerun: its Prefect flow run and its MLflow
    # stage run (snapshot_reference, killed mid-registration) no longer claim to be running
    assert "marked Crashed" in rerun.stderr and "MLflow run(s) marked FAILED (snapshot_reference)" in rerun.stderr
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments, filter_string="attributes.status = 'RUNNING'") == []
