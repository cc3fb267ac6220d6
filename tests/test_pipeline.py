"""Issue 4 end to end: finished work is never redone, on configs/tiny.yaml with the real Prefect
engine (one temporary server for the session) and real MLflow.

The scenarios run once per session (tests/pipeline_fixtures.py); each test reads what one of
them returned or left on disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.pipeline_fixtures")

from tests.pipeline_fixtures import TINY_CONFIG, UPSTREAM, Run, checkpoint_iterations, run_cli  # noqa: E402

pytest_plugins = ["tests.pipeline_fixtures"]
pytestmark = pytest.mark.slow

TWO_ROUND_STAGES = [*UPSTREAM, "ppo_round_1", "ppo_round_2", "evaluate"]
THREE_ROUND_STAGES = [*UPSTREAM, "ppo_round_1", "ppo_round_2", "ppo_round_3", "evaluate"]


def test_first_run_computes_every_stage_in_order(first_run: Run) -> None:
    assert list(first_run.stages) == TWO_ROUND_STAGES
    assert set(first_run.stages.values()) == {"Completed"}
    assert first_run.result["champion"] is True  # tiny.yaml's gates are lenient
    assert len(first_run.result["policy_sha256"]) == 64


def test_rerun_recomputes_nothing(first_run: Run, second_run: Run) -> None:
    """Consequence 1: every stage Cached, same outputs, much faster than the first run."""
    assert list(second_run.stages) == TWO_ROUND_STAGES
    assert set(second_run.stages.values()) == {"Cached"}, second_run.stages
    assert second_run.result["policy_sha256"] == first_run.result["policy_sha256"]
    assert second_run.result["policy_path"] == first_run.result["policy_path"]
    # Nothing was written for a new stage run either.
    assert second_run.notes["stage_folders"] == first_run.notes["stage_folders"]


def test_changed_ppo_setting_reruns_only_ppo_and_evaluation(
    first_run: Run, new_lr_run: Run
) -> None:
    """Consequence 2."""
    assert {s: new_lr_run.stages[s] for s in UPSTREAM} == dict.fromkeys(UPSTREAM, "Cached")
    assert {s: new_lr_run.stages[s] for s in ("ppo_round_1", "ppo_round_2", "evaluate")} == {
        "ppo_round_1": "Completed",
        "ppo_round_2": "Completed",
        "evaluate": "Completed",
    }
    assert new_lr_run.result["policy_sha256"] != first_run.result["policy_sha256"]


def test_force_recomputes_the_stage_and_everything_downstream(forced_run: Run) -> None:
    """Consequence 4: --force train_reward_model."""
    assert forced_run.stages == {
        "snapshot_reference": "Cached",
        "collect_preferences": "Cached",
        "train_reward_model": "Completed",
        "ppo_round_1": "Completed",
        "ppo_round_2": "Completed",
        "evaluate": "Completed",
    }
    # The forced rounds trained from their start, not from the in-round checkpoints the first
    # run left under the same cache key.
    assert forced_run.notes["round_steps"] == {"ppo_round_1": [1, 2], "ppo_round_2": [3, 4]}


def test_force_covers_downstream_stages_and_rejects_unknown_ones() -> None:
    from flows.pipeline import forced_stages

    with pytest.raises(ValueError, match="nope"):
        forced_stages(["nope"])
    assert forced_stages(["ppo_round"]) == {"ppo_round", "evaluate"}
    # Downstream in pipeline order: the reference snapshot comes first, so it is never dragged in.
    assert forced_stages(["train_reward_model"]) == {"train_reward_model", "ppo_round", "evaluate"}
    assert forced_stages(["collect_preferences"]) == {
        "collect_preferences",
        "train_reward_model",
        "ppo_round",
        "evaluate",
    }


def test_stages_reports_cached_after_a_run_and_missing_after_a_change(first_run: Run) -> None:
    """Consequence 5, in-process (flows.stage_status.stage_table, what `rlhf stages` prints)."""
    assert first_run.notes["stages_after"] == dict.fromkeys(TWO_ROUND_STAGES, "cached")
    new_lr = first_run.notes["stages_new_lr"]
    assert {s: new_lr[s] for s in UPSTREAM} == dict.fromkeys(UPSTREAM, "cached")
    assert {s: new_lr[s] for s in ("ppo_round_1", "ppo_round_2", "evaluate")} == dict.fromkeys(
        ("ppo_round_1", "ppo_round_2", "evaluate"), "missing"
    )
    new_rm = first_run.notes["stages_new_rm"]
    assert new_rm["snapshot_reference"] == new_rm["collect_preferences"] == "cached"
    assert {
        new_rm[s] for s in ("train_reward_model", "ppo_round_1", "ppo_round_2", "evaluate")
    } == {"missing"}


def test_stages_cli_prints_cached_keys(second_run: Run, pipeline_env: Path) -> None:
    """Consequence 5 through the CLI: one line per stage with status and the key the flow used."""
    proc = run_cli(
        "stages", str(TINY_CONFIG), cwd=second_run.folder, env={"RLHF_TINY_DIR": str(pipeline_env)}
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    assert [row[0] for row in lines] == TWO_ROUND_STAGES
    assert all(row[1] == "cached" for row in lines), proc.stdout
    assert all(row[2].startswith(row[0].removesuffix("_1").removesuffix("_2")) for row in lines)
    stored = {p.name for p in (second_run.folder / ".rlhf" / "tiny" / "results").iterdir()}
    assert {row[2] for row in lines} <= stored  # each printed key names a persisted result


# --- consequence 3: a crash in round 2 of 3, then the same config again ---------------------


def test_injected_failure_stops_in_round_two_after_a_checkpoint(crashed_run: Run) -> None:
    assert crashed_run.result is None
    assert "RLHF_FAIL_AT" in str(crashed_run.error) and "round 2" in str(crashed_run.error)
    before = crashed_run.notes["stages_before_rerun"]
    assert {s: before[s] for s in [*UPSTREAM, "ppo_round_1"]} == dict.fromkeys(
        [*UPSTREAM, "ppo_round_1"], "cached"
    )
    assert before["ppo_round_2"] == before["ppo_round_3"] == before["evaluate"] == "missing"
    # Round 2's in-round state folder holds the checkpoint of its first iteration (global 2+1).
    state_dir = crashed_run.notes["round_2_state_dir"]
    assert crashed_run.notes["round_2_checkpoints"] == [3], state_dir
    assert not (state_dir.parent / "policy").exists()  # the round never finished


def test_rerun_after_failure_skips_finished_work_and_resumes_round_two(
    crashed_run: Run, resumed_run: Run
) -> None:
    assert list(resumed_run.stages) == THREE_ROUND_STAGES
    assert resumed_run.stages == {
        "snapshot_reference": "Cached",
        "collect_preferences": "Cached",
        "train_reward_model": "Cached",
        "ppo_round_1": "Cached",
        "ppo_round_2": "Completed",
        "ppo_round_3": "Completed",
        "evaluate": "Completed",
    }
    # The resumed trainer started at iteration 3 (the in-round checkpoint), not at 2 (round start):
    # round 2's crashed attempt logged iteration 3, the resumed one only iteration 4.
    assert crashed_run.notes["round_2_steps"] == [3]
    assert resumed_run.notes["round_2_steps"] == [4]
    # the finished round kept only the checkpoint round 3 started from
    assert checkpoint_iterations(crashed_run.notes["round_2_state_dir"]) == [4]


def test_resumed_policy_equals_an_uninterrupted_run(
    resumed_run: Run, uninterrupted_three_rounds: Run
) -> None:
    assert uninterrupted_three_rounds.folder != resumed_run.folder
    for stage in ("ppo_round_1", "ppo_round_2", "ppo_round_3", "evaluate"):
        assert uninterrupted_three_rounds.stages[stage] == "Completed"
    assert resumed_run.result["policy_sha256"] == uninterrupted_three_rounds.result["policy_sha256"]
