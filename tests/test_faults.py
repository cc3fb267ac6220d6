"""Faults lose nothing: damaged outputs behind a cached stage are found and recomputed.

Runs the tiny pipeline with the real Prefect engine and MLflow (tests/pipeline_fixtures.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.pipeline_fixtures")

from tests.pipeline_fixtures import Run  # noqa: E402

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
