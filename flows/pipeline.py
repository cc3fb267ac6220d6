"""The top-level flow: reference -> preferences -> reward model -> PPO rounds -> evaluation.

Every stage is a Prefect task whose cache key is computed here from its own config section
and the content hashes of what it reads (flows.caching). Results persist in the work folder,
so a rerun of the same config finds every stage Cached, a changed PPO setting reruns only PPO
and evaluation, and a crash resumes at the stage (and in-round checkpoint) where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import get_run_context
from prefect.tasks import exponential_backoff

from flows import keys
from flows import tracking as trk
from flows.caching import STAGES
from flows.config import PipelineConfig
from flows.faults import kill_point
from flows.human import collect_human_labels, sample_pairs_for_labelling
from flows.locks import record_holder, work_folder_lock
from flows.logs import library_logs_at_info
from flows.orphans import close_orphans
from flows.records import RECORD_SERIALIZER, RecordStorage
from flows.refs import ReferenceRef, StageRef
from flows.runtime import configure_heap, release_free_heap
from flows.stages.common import placement
from flows.stages.evaluate import evaluate
from flows.stages.ppo import ppo_round
from flows.stages.preferences import collect_preferences
from flows.stages.reference import snapshot_reference
from flows.stages.reward import train_reward_model
from flows.summary import CpuTime, StageRecord, summary_markdown
from ppo_core.config import DeviceConfig
from ppo_core.lm.folders import remove_debris
from ppo_core.lm.peak_memory import PeakMemory


def config_hash(cfg: PipelineConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


def forced_stages(force: list[str] | None) -> set[str]:
    """A forced stage and everything downstream of it (their inputs would change anyway)."""
    if not force:
        return set()
    unknown = [s for s in force if s not in STAGES]
    if unknown:
        raise ValueError(f"--force: unknown stage(s) {unknown}; stages are {list(STAGES)}")
    first = min(STAGES.index(s) for s in force)
    return set(STAGES[first:])


class StageFailed(RuntimeError):
    """A stage's task failed: the stage's name and its exception in one message."""

    names_itself = True  # flows.logs.one_line prints the message as it is

    def __init__(self, label: str, error: BaseException) -> None:
        super().__init__(f"{label} failed: {type(error).__name__}: {error}")
        self.label, self.error = label, error


class StageRunner:
    """Calls stage tasks with the pipeline's storage, retries and forced refreshes, and records
    for the summary whether each ran or came from the cache."""

    def __init__(self, cfg: PipelineConfig, work_dir: Path, ctx: trk.TrackingContext, forced: set[str]) -> None:
        self.cfg, self.ctx, self.forced = cfg, ctx, forced
        self.storage = RecordStorage.for_folder(work_dir / "results")  # JSON records only (flows.records)
        self.records: list[StageRecord] = []

    def __call__(self, stage_task: Any, stage: str, label: str, **kwargs: Any) -> Any:
        start, memory, cpu = time.perf_counter(), PeakMemory().start(), CpuTime().start()
        state = self._configured(stage_task, refresh=stage in self.forced)(return_state=True, **kwargs)
        result = _result(state, label)
        cached = state.name == "Cached"
        problems = result.problems() if cached and isinstance(result, StageRef) else []
        if problems:
            get_run_logger().warning(
                "%s: the cached result's outputs changed on disk (%s); recomputing the stage",
                label, "; ".join(problems),
            )
            state = self._configured(stage_task, refresh=True)(return_state=True, **kwargs)
            result, cached = _result(state, label), False
        if cached:
            trk.record_cached(self.ctx, label, getattr(result, "mlflow_run_id", None), _headline(result))
        peaks, cpu_s = memory.read(), cpu.read()
        trk.log_stage_usage(self.ctx, label, {"memory": peaks, "cpu": cpu_s})
        self.records.append(StageRecord(label, cached, time.perf_counter() - start, _headline(result), result, peaks, cpu_s))
        release_free_heap()
        kill_point(f"after:{label}")
        return result

    def _configured(self, stage_task: Any, refresh: bool) -> Any:
        orch = self.cfg.orchestration
        return stage_task.with_options(
            result_storage=self.storage,
            result_serializer=RECORD_SERIALIZER,
            retries=orch.retries,
            retry_delay_seconds=exponential_backoff(backoff_factor=orch.retry_delay_seconds) if orch.retries else 0,
            refresh_cache=refresh,
        )


def _result(state: Any, label: str) -> Any:
    """The stage's result, or StageFailed naming the stage when its task failed or crashed."""
    if state.is_failed() or state.is_crashed():
        error = state.result(raise_on_failure=False)
        if isinstance(error, BaseException):
            raise StageFailed(label, error) from error
    return state.result()


def _headline(result: Any) -> dict[str, Any]:
    fields = ("n_rows", "eval_accuracy", "gold_agreement", "iteration", "champion")
    out = {f: getattr(result, f) for f in fields if hasattr(result, f)}
    out.update(getattr(result, "headline", {}) or {})
    metrics = getattr(result, "metrics", {}) or {}
    out.update({k: v for k, v in metrics.items() if k in ("objective/scores", "objective/kl")})
    return out


def _human_labels(run: StageRunner, cfg: PipelineConfig, reference: ReferenceRef, work_dir: str) -> str:
    """Sample pairs (cached), then pause the flow for people to label them in the Prefect UI."""
    source = cfg.preferences.source
    unlabelled = run(
        sample_pairs_for_labelling, "collect_preferences", "sample_pairs_for_labelling",
        key=keys.human_pairs_key(cfg, reference), source=source, prompt_cfg=cfg.prompts,
        device=cfg.orchestration.device, reference=reference,
        work_dir=work_dir,
    )
    return collect_human_labels(unlabelled, source.pairs_per_form, source.timeout_seconds)


def _open_tracking(cfg: PipelineConfig, work_dir: Path, flow_run_id: str) -> trk.TrackingContext:
    uri = cfg.tracking.uri or trk.default_tracking_uri(Path.cwd())
    experiment = cfg.tracking.experiment or cfg.name
    experiment_id = trk.connect(uri, experiment, Path.cwd() / "mlruns")
    ctx = trk.TrackingContext(
        uri=uri, experiment_id=experiment_id, pipeline=cfg.name, flow_run_id=flow_run_id, config_hash=config_hash(cfg),
        register_models=cfg.tracking.register_models,
    )
    ctx.parent_run_id = trk.open_parent_run(
        ctx, f"{cfg.name}-{flow_run_id[:8]}", cfg.model_dump(mode="json"), resolved_device(cfg.orchestration.device)
    )
    return ctx


def resolved_device(device: DeviceConfig) -> dict[str, str]:
    """What `device` and `precision` resolve to on this machine, and why (run params and summary)."""
    where = placement(device)
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(where.dtype, str(where.dtype))
    return {"device": str(where.device), "precision": dtype, "precision_reason": where.reason}


@flow(name="rlhf_pipeline", log_prints=True)
def rlhf_pipeline(config: dict[str, Any], force: list[str] | None = None) -> dict[str, Any]:
    """Run (or resume) the whole pipeline for one validated config."""
    library_logs_at_info()
    configure_heap()
    cfg = PipelineConfig.model_validate(config)
    work_dir = pipeline_work_dir(cfg)
    with work_folder_lock(work_dir):
        return _run_stages(cfg, work_dir, force)


def pipeline_work_dir(cfg: PipelineConfig) -> Path:
    """Where this pipeline's stages, results and checkpoints live (one run at a time)."""
    return (Path(cfg.orchestration.work_dir) / cfg.name).resolve()


def _run_stages(cfg: PipelineConfig, work_dir: Path, force: list[str] | None) -> dict[str, Any]:
    log = get_run_logger()
    work_dir.mkdir(parents=True, exist_ok=True)
    flow_run_id = str(get_run_context().flow_run.id)
    ctx = _open_tracking(cfg, work_dir, flow_run_id)
    killed = record_holder(work_dir, flow_run_id=flow_run_id)
    if killed is not None:
        for line in close_orphans(ctx, killed):
            log.warning("an earlier run in %s was killed: %s", work_dir, line)
    debris = remove_debris(work_dir / "stages")  # under the lock: no writer is running there
    if debris:
        log.warning("removed %d unfinished file(s) of a killed run: %s", len(debris), ", ".join(p.name for p in debris))
    run = StageRunner(cfg, work_dir, ctx, forced_stages(force))
    common = {"work_dir": str(work_dir), "tracking": ctx}
    device = cfg.orchestration.device
    failed = True
    try:
        reference = run(
            snapshot_reference, "snapshot_reference", "snapshot_reference",
            key=keys.reference_key(cfg),
            source=cfg.reference_source, tokenizer_source=cfg.model.tokenizer,
            trust_remote_code=cfg.model.trust_remote_code, **common,
        )
        labels = None
        if cfg.preferences.source.kind == "human":
            labels = _human_labels(run, cfg, reference, str(work_dir))
        prefs = run(
            collect_preferences, "collect_preferences", "collect_preferences",
            key=keys.preferences_key(cfg, reference, labels),
            preferences=cfg.preferences, prompts=cfg.prompts, device=device, reference=reference, labels_path=labels,
            **common,
        )
        reward = run(
            train_reward_model, "train_reward_model", "train_reward_model",
            key=keys.reward_key(cfg, prefs, reference),
            reward_model=cfg.reward_model, prompts=cfg.prompts, gold_scorer=cfg.evaluation.gold_scorer,
            sampling=cfg.ppo.sampling, device=device, prefs=prefs, reference=reference, **common,
        )
        policies = []
        previous = None
        for k in range(1, cfg.ppo.rounds + 1):
            previous = run(
                ppo_round, "ppo_round", f"ppo_round_{k}",
                key=keys.ppo_key(cfg, k, reference, reward, prefs, previous),
                round_number=k, ppo=cfg.ppo, prompts=cfg.prompts, device=device,
                reference=reference, reward=reward, prefs=prefs,
                previous=previous, is_last=k == cfg.ppo.rounds, restart="ppo_round" in run.forced, **common,
            )
            policies.append(previous)
        report = run(
            evaluate, "evaluate", "evaluate",
            key=keys.evaluate_key(cfg, policies, reference, reward),
            evaluation=cfg.evaluation, prompts=cfg.prompts, device=device,
            reference=reference, reward=reward, prefs=prefs, policies=policies, **common,
        )
        failed = False
    finally:
        trk.close_parent_run(ctx, failed)
        if run.records:
            markdown = summary_markdown(cfg, ctx, run.records, failed)
            create_markdown_artifact(markdown=markdown, key=f"{cfg.name}-summary", description="RLHF pipeline run")
            (work_dir / "last_summary.md").write_text(markdown)
    log.info("pipeline %s finished: %s", cfg.name, ", ".join(f"{r.label}={'cached' if r.cached else 'ran'}" for r in run.records))
    return {
        "stages": {r.label: ("Cached" if r.cached else "Completed") for r in run.records},
        "policy_sha256": policies[-1].sha256,
        "policy_path": policies[-1].path,
        "policy_uri": policies[-1].model_uri,
        "reward_model_uri": reward.model_uri,
        "reference_uri": reference.model_uri,
        "champion": report.champion,
        "champion_round": report.champion_round,
        "champion_uri": report.champion_model_uri,
        "report_path": report.path,
        "mlflow_uri": ctx.uri,
        "mlflow_parent_run_id": ctx.parent_run_id,
        "flow_run_id": flow_run_id,
        "resolved": resolved_device(cfg.orchestration.device),
    }
