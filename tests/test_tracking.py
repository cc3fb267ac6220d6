"""Issue 5 end to end: MLflow runs and the Model Registry, on the runs of tests/test_pipeline.py
(the session fixtures in tests/pipeline_fixtures.py run each pipeline scenario once)."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
import torch
import yaml

from ppo_core.lm.precision import resolve_precision

pytest.register_assert_rewrite("tests.pipeline_fixtures")

from tests.pipeline_fixtures import (  # noqa: E402
    NAMES,
    TINY_CONFIG,
    UPSTREAM,
    Run,
    load_cfg,
    metric_steps,
    run_cli,
    run_pipeline,
    stage_child_runs,
)

pytest_plugins = ["tests.pipeline_fixtures"]
pytestmark = pytest.mark.slow

STAGES = [*UPSTREAM, "ppo_round_1", "ppo_round_2", "evaluate"]


def client(run: Run):
    from mlflow import MlflowClient

    return MlflowClient(run.tracking_uri)


def runs_of_parent(run: Run, parent_id: str) -> list:
    c = client(run)
    experiment = c.get_run(parent_id).info.experiment_id
    return c.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")


def parent_runs(run: Run) -> list:
    c = client(run)
    experiments = [e.experiment_id for e in c.search_experiments()]
    return c.search_runs(experiments, filter_string="tags.`rlhf.pipeline_run` = 'true'")


def version_of(uri: str) -> str:
    """models:/NAME/VERSION -> VERSION"""
    return uri.rsplit("/", 1)[1]


def test_three_registered_models_with_aliases(first_run: Run) -> None:
    registry = first_run.notes["registry"]
    assert set(registry) == set(NAMES)
    assert all(len(entry["versions"]) == 1 for entry in registry.values()), registry
    policy_version = version_of(first_run.result["policy_uri"])
    assert registry["tiny-policy"]["versions"] == [policy_version]
    assert registry["tiny-policy"]["aliases"] == {
        "candidate": policy_version,
        "champion": policy_version,
    }
    assert (
        first_run.result["reward_model_uri"]
        == f"models:/tiny-reward-model/{registry['tiny-reward-model']['versions'][0]}"
    )
    assert (
        first_run.result["reference_uri"]
        == f"models:/tiny-reference/{registry['tiny-reference']['versions'][0]}"
    )


def test_policy_version_carries_its_lineage(first_run: Run) -> None:
    from flows.caching import sha256_file
    from flows.pipeline import config_hash

    tags = first_run.notes["registry"]["tiny-policy"]["tags"][
        version_of(first_run.result["policy_uri"])
    ]
    prefs_files = list(
        (first_run.folder / ".rlhf" / "tiny" / "stages" / "collect_preferences").glob(
            "*/preferences.*"
        )
    )
    assert len(prefs_files) == 1
    assert tags["rlhf.config_hash"] == config_hash(load_cfg())
    assert tags["rlhf.preference_sha256"] == sha256_file(prefs_files[0])
    assert tags["rlhf.reward_model_version"] == version_of(first_run.result["reward_model_uri"])
    assert tags["rlhf.reference_version"] == version_of(first_run.result["reference_uri"])
    assert tags["prefect.flow_run_id"] == first_run.flow_run_id == first_run.result["flow_run_id"]
    assert tags["rlhf.sha256"] == first_run.result["policy_sha256"]


def test_one_parent_run_with_a_child_run_per_stage(first_run: Run, tmp_path: Path) -> None:
    from flows.pipeline import config_hash

    c = client(first_run)
    parent_id = first_run.result["mlflow_parent_run_id"]
    parent = c.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] == first_run.flow_run_id
    assert parent.data.tags["rlhf.config_hash"] == config_hash(load_cfg())
    assert parent.data.params["ppo.rounds"] == "2"  # the flattened resolved config
    assert parent.data.params["ppo.algo.learning_rate"] == "0.001"
    # what `auto` became on this machine, and why: run params and the CLI summary's source
    dtype, reason = resolve_precision(load_cfg().orchestration.device.precision, torch.device("cpu"))
    assert parent.data.params["resolved.device"] == "cpu"
    assert parent.data.params["resolved.precision"] == {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    assert parent.data.params["resolved.precision_reason"] == reason == first_run.result["resolved"]["precision_reason"]
    assert parent.data.tags.get("rlhf.code_version")
    resolved_file = c.download_artifacts(parent_id, "config.resolved.yaml", str(tmp_path))
    resolved = yaml.safe_load(Path(resolved_file).read_text())
    assert resolved == load_cfg().model_dump(mode="json")
    children = [
        r
        for r in runs_of_parent(first_run, parent_id)
        if r.data.tags.get("prefect.flow_run_id") == first_run.flow_run_id
    ]
    assert sorted(r.data.tags["rlhf.stage"] for r in children) == sorted(STAGES)
    assert {r.data.tags["rlhf.cached"] for r in children} == {"false"}


def summary_rows(run: Run) -> dict[str, list[str]]:
    return {line.split(" | ")[0].strip("| "): line.split(" | ") for line in run.notes["summary"].splitlines()}


def test_each_stage_peak_memory_in_the_parent_run_and_the_summary(first_run: Run) -> None:
    """Per stage, this process's peak RSS while it ran: a parent-run metric and a summary column
    (tests/test_memory.py checks the measurement itself)."""
    metrics = client(first_run).get_run(first_run.result["mlflow_parent_run_id"]).data.metrics
    peaks = {stage: metrics[f"memory/{stage}/peak_rss_mib"] for stage in STAGES}
    rows = summary_rows(first_run)
    for stage, peak in peaks.items():
        assert 100 < peak < 64 * 1024, (stage, peak)
        assert rows[stage][4] == f"{peak:,.0f}", (stage, rows[stage])
    assert "peak RSS MiB" in first_run.notes["summary"]


def test_each_stage_cpu_time_in_the_parent_run_and_the_summary(first_run: Run) -> None:
    """Per stage, the user and kernel CPU seconds it took: parent-run metrics and a summary
    column. Each stage of the first run did work (tokenising, a forward at least), and all of
    them together took no more CPU than the whole pytest process has so far."""
    metrics = client(first_run).get_run(first_run.result["mlflow_parent_run_id"]).data.metrics
    rows = summary_rows(first_run)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = {"user_s": 0.0, "sys_s": 0.0}
    for stage in STAGES:
        cpu = {key: metrics[f"cpu/{stage}/{key}"] for key in ("user_s", "sys_s")}
        assert cpu["user_s"] > 0.05 and cpu["sys_s"] >= 0, (stage, cpu)
        assert rows[stage][3] == f"{cpu['user_s']:.0f} / {cpu['sys_s']:.0f}", (stage, rows[stage])
        total = {key: total[key] + cpu[key] for key in total}
    assert total["user_s"] <= own.ru_utime + children.ru_utime
    assert total["sys_s"] <= own.ru_stime + children.ru_stime
    assert "CPU user / sys s" in first_run.notes["summary"]


def test_cached_stages_are_recorded_as_cached_child_runs(first_run: Run, second_run: Run) -> None:
    parent_id = second_run.result["mlflow_parent_run_id"]
    assert parent_id != first_run.result["mlflow_parent_run_id"]  # the first one finished
    children = {r.data.tags["rlhf.stage"]: r for r in runs_of_parent(second_run, parent_id)}
    assert sorted(children) == sorted(STAGES)
    producers = {
        r.data.tags["rlhf.stage"]: r.info.run_id
        for r in runs_of_parent(first_run, first_run.result["mlflow_parent_run_id"])
    }
    for stage, child in children.items():
        assert child.data.tags["rlhf.cached"] == "true", stage
        assert child.data.tags["rlhf.cached_from_run"] == producers[stage], stage


def test_ppo_rounds_log_one_metric_point_per_iteration(first_run: Run) -> None:
    per_round = load_cfg().ppo.iterations_per_round
    assert metric_steps(first_run, "ppo_round_1") == list(range(1, per_round + 1))
    assert metric_steps(first_run, "ppo_round_2") == list(range(per_round + 1, 2 * per_round + 1))
    assert metric_steps(first_run, "ppo_round_1", "objective/scores") == list(
        range(1, per_round + 1)
    )


def test_reward_model_metrics_are_logged_per_step(first_run: Run) -> None:
    (rm_run,) = stage_child_runs(first_run, "train_reward_model")
    assert "eval_accuracy" in rm_run.data.metrics
    stepped = [
        k
        for k in rm_run.data.metrics
        if len(client(first_run).get_metric_history(rm_run.info.run_id, k)) > 1
    ]
    assert stepped, f"no per-step reward-model metric among {sorted(rm_run.data.metrics)}"


def test_preference_set_is_a_dataset_input_with_its_sha256(first_run: Run) -> None:
    from flows.caching import sha256_file

    (prefs_run,) = stage_child_runs(first_run, "collect_preferences")
    (prefs_file,) = (first_run.folder / ".rlhf" / "tiny" / "stages" / "collect_preferences").glob(
        "*/preferences.*"
    )
    (dataset_input,) = prefs_run.inputs.dataset_inputs
    assert sha256_file(prefs_file).startswith(dataset_input.dataset.digest)
    artifacts = {a.path for a in client(first_run).list_artifacts(prefs_run.info.run_id)}
    assert "preference_set.json" in artifacts


def test_ppo_rounds_log_samples_and_curves(first_run: Run) -> None:
    c = client(first_run)
    for k in (1, 2):
        (round_run,) = stage_child_runs(first_run, f"ppo_round_{k}")
        samples = {a.path for a in c.list_artifacts(round_run.info.run_id, "samples")}
        plots = {a.path for a in c.list_artifacts(round_run.info.run_id, "plots")}
        assert f"samples/round-{k}.json" in samples
        assert any(p.endswith(".png") for p in plots), plots


def test_evaluation_logs_paired_gain_errors_over_tiled_samples(first_run: Run) -> None:
    """tiny.yaml samples 2 responses per held-out prompt: the report keeps prompts and samples
    apart, and the gain's paired standard error reaches MLflow and the markdown table."""
    from ppo_core.eval.report import EvalReport

    (eval_run,) = stage_child_runs(first_run, "evaluate")
    metrics = eval_run.data.metrics
    assert {"policy/gold_gain_se", "policy/gold_reward_se", "gold_gain_se"} <= set(metrics)
    report = EvalReport.model_validate_json(Path(first_run.result["report_path"]).read_text())
    cfg = load_cfg().evaluation
    assert report.reference.samples_per_prompt == cfg.samples_per_prompt == 2
    assert report.final is not None and report.final.n == cfg.n_prompts
    assert report.final.gold_gain_se == metrics["gold_gain_se"] > 0
    markdown = client(first_run).download_artifacts(eval_run.info.run_id, "report.md")
    assert f"| {cfg.n_prompts} x 2 |" in Path(markdown).read_text()


def test_second_run_adds_no_model_versions(first_run: Run, second_run: Run) -> None:
    before, after = first_run.notes["registry"], second_run.notes["registry"]
    assert set(after) == set(before) == set(NAMES)
    for name in NAMES:
        assert after[name]["versions"] == before[name]["versions"], name
        assert after[name]["aliases"] == before[name]["aliases"], name


def test_resumed_pipeline_continues_the_same_parent_run(crashed_run: Run, resumed_run: Run) -> None:
    parents = parent_runs(resumed_run)
    assert [p.info.run_id for p in parents] == [resumed_run.result["mlflow_parent_run_id"]]
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    (failed_round,) = stage_child_runs(crashed_run, "ppo_round_2")
    assert failed_round.info.status == "FAILED"
    assert failed_round.data.tags["mlflow.parentRunId"] == parent.info.run_id
    children = runs_of_parent(resumed_run, parent.info.run_id)
    flow_runs = {r.data.tags["prefect.flow_run_id"] for r in children}
    assert flow_runs == {crashed_run.flow_run_id, resumed_run.flow_run_id}
    # The stages the rerun took from the cache link to the crashed run's child runs.
    produced = {
        r.data.tags["rlhf.stage"]: r.info.run_id
        for r in children
        if r.data.tags["prefect.flow_run_id"] == crashed_run.flow_run_id
        and r.data.tags["rlhf.cached"] == "false"
    }
    cached = {
        r.data.tags["rlhf.stage"]: r.data.tags["rlhf.cached_from_run"]
        for r in children
        if r.data.tags["prefect.flow_run_id"] == resumed_run.flow_run_id
        and r.data.tags["rlhf.cached"] == "true"
    }
    assert sorted(cached) == sorted([*UPSTREAM, "ppo_round_1"])
    assert all(cached[stage] == produced[stage] for stage in cached), (cached, produced)


def test_bad_tracking_uri_fails_fast_before_prefect_or_training(
    pipeline_env: Path, tmp_path: Path
) -> None:
    """Through the CLI (no PREFECT_API_URL: the check must come before Prefect is even needed)."""
    bad = "http://127.0.0.1:9/"  # a closed local port
    start = time.perf_counter()
    proc = run_cli(
        "run",
        str(TINY_CONFIG),
        "--set",
        f"tracking.uri={bad}",
        cwd=tmp_path,
        env={"RLHF_TINY_DIR": str(pipeline_env)},
    )
    seconds = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and f"tracking.uri {bad!r}" in error_lines[0], proc.stderr[-3000:]
    assert not (tmp_path / ".rlhf" / "tiny").exists()  # the flow never started, no stage ran
    assert seconds < 90, seconds


def test_bad_tracking_uri_stops_the_flow_before_any_stage(
    pipeline_env: Path, tmp_path: Path
) -> None:
    """The flow's own check (deployments and `rlhf resume` do not pass through `rlhf run`)."""
    from flows.tracking import TrackingError

    bad = "http://127.0.0.1:9/"
    run = run_pipeline(tmp_path, [f"tracking.uri={bad}"])
    assert run.result is None
    assert isinstance(run.error, TrackingError) and bad in str(run.error)
    assert not (tmp_path / ".rlhf" / "tiny" / "stages").exists()


def test_best_round_promotion_registers_an_earlier_round_as_champion(best_round_run: Run) -> None:
    run = best_round_run
    assert run.result is not None, f"run failed: {run.error!r}"
    upstream = {stage: status for stage, status in run.stages.items() if stage != "evaluate"}
    assert run.stages["evaluate"] == "Completed" and set(upstream.values()) == {"Cached"}
    report = json.loads(Path(run.result["report_path"]).read_text())
    inside = {int(k): e["gold_reward"] for k, e in report["rounds"].items() if e["kl_exact"] <= run.notes["budget"]}
    expected = max(sorted(inside), key=lambda k: inside[k])  # the earliest on ties
    assert run.result["champion"] is True and run.result["champion_round"] == expected != 3
    policy = run.notes["registry"]["tiny-policy"]
    version = policy["aliases"]["champion"]
    assert policy["tags"][version]["rlhf.round"] == str(expected)
    assert policy["aliases"]["candidate"] != version  # the last round stays the candidate
    assert run.result["champion_uri"] == f"models:/tiny-policy/{version}"
    (eval_run,) = stage_child_runs(run, "evaluate")  # headline: the champion's numbers, not the last round's
    champion = report["rounds"][str(expected)]
    assert eval_run.data.metrics["champion_gold"] == pytest.approx(champion["gold_reward"])
    assert eval_run.data.metrics["champion_kl_exact"] == pytest.approx(champion["kl_exact"])
