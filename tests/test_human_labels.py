"""People in the loop: the pipeline pauses for labels in Prefect, and continues with them.

Runs the real flow on tiny models against a temporary Prefect server; a "person" (this test)
finds the paused flow run and submits the form through Prefect's own resume API.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.flow_runs import resume_flow_run
from prefect.testing.utilities import prefect_test_harness

from flows.config import load_config
from flows.pipeline import rlhf_pipeline

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
HUMAN = [
    "preferences.source={kind: human, responses_per_prompt: 2, n_prompts: 3, pairs_per_form: 10, timeout_seconds: 300, sampling: {max_new_tokens: 5}}",
    "ppo.rounds=1",
    "ppo.iterations_per_round=1",
    "evaluation.n_prompts=4",
    "evaluation.per_round=false",
]


def _paused_run_id(deadline: float) -> str:
    with get_client(sync_client=True) as client:
        while time.time() < deadline:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])))
            )
            if runs:
                return str(runs[0].id)
            time.sleep(1.0)
    raise AssertionError("the pipeline never paused for labels")


@pytest.mark.timeout(900)
def test_human_source_pauses_for_a_form_and_trains_on_the_submitted_labels(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLHF_TINY_DIR", str(tmp_path / "tiny"))
    cfg = load_config(CONFIG, HUMAN)
    outcome: dict = {}

    def run_pipeline() -> None:
        try:
            outcome["result"] = rlhf_pipeline(config=cfg.model_dump(mode="json"))
        except BaseException as exc:  # surfaced by the assertion below
            outcome["error"] = exc

    with prefect_test_harness(server_startup_timeout=180):
        worker = threading.Thread(target=run_pipeline, daemon=True)
        worker.start()
        run_id = _paused_run_id(time.time() + 600)
        unlabelled = next(tmp_path.glob(".rlhf/tiny/stages/sample_pairs_for_labelling/*/unlabelled.jsonl"))
        pairs = [json.loads(line) for line in unlabelled.read_text().splitlines()]
        assert pairs, "no pairs were shown to the labeller"
        answers = {f"pair_{i + 1}": ("a" if i % 2 == 0 else "b") for i in range(len(pairs))}
        resume_flow_run(run_id, run_input=answers)
        worker.join(timeout=600)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"]["stages"]["collect_preferences"] == "Completed"
    labels = [json.loads(line) for line in unlabelled.with_name("labels.jsonl").read_text().splitlines()]
    assert [item["preferred"] for item in labels] == list(answers.values())
    preference_files = list(tmp_path.glob(".rlhf/tiny/stages/collect_preferences/*/preferences.jsonl"))
    rows = [json.loads(line) for line in preference_files[0].read_text().splitlines()]
    assert len(rows) == len(pairs)
    for pair, row in zip(pairs, rows, strict=True):
        expected = pair["a"] if answers[f"pair_{pairs.index(pair) + 1}"] == "a" else pair["b"]
        assert row["chosen"] == expected
