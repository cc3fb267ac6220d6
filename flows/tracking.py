"""MLflow runs of a pipeline: one parent run per pipeline run, one child run per stage.

Stages receive a `TrackingContext` (plain data, safe to pass as a Prefect task parameter and
left out of cache keys) and open their child run with `stage_run`. The parent run of a failed
pipeline is continued by the next `rlhf run` of the same config, so a resumed pipeline keeps
one run tree; a cached stage still gets a child run, tagged `rlhf.cached=true` and linked to
the run that computed it.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow import MlflowClient
from mlflow.entities import RunStatus
from pydantic import BaseModel

from flows.faults import kill_point
from flows.locks import creation_lock

PARENT_TAG = "rlhf.pipeline_run"
CONFIG_HASH_TAG = "rlhf.config_hash"


class TrackingError(RuntimeError):
    """The tracking server cannot be used; raised before any training starts."""


class TrackingContext(BaseModel):
    """Where a stage logs: enough to reopen the right runs from any thread or process."""

    uri: str = ""
    experiment_id: str = ""
    parent_run_id: str = ""
    pipeline: str = "rlhf"
    flow_run_id: str = ""
    config_hash: str = ""
    register_models: bool = True
    """Register the stages' models in the Model Registry (tracking.register_models)."""


def default_tracking_uri(work_dir: str | Path = ".") -> str:
    """$MLFLOW_TRACKING_URI, else an absolute sqlite file in the working directory."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(Path(work_dir).resolve() / 'mlflow.db').as_posix()}"


def fail_fast_over_http() -> None:
    """An unreachable tracking server is reported in seconds, not after MLflow's minutes of
    retries (a value already in the environment wins)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def connect(uri: str, experiment: str, artifact_root: Path | None = None) -> str:
    """Point mlflow at `uri`, check that it answers, and return the experiment id.

    A wrong URI fails here, in seconds, with the URI in the message, not after training.
    """
    mlflow.set_tracking_uri(uri)
    fail_fast_over_http()
    try:
        create_sqlite_store(uri)
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            return found.experiment_id
        location = artifact_root.resolve().as_uri() if artifact_root is not None and uri.startswith("sqlite") else None
        return client.create_experiment(experiment, artifact_location=location)
    except Exception as exc:  # mlflow raises many types for unreachable/misconfigured stores
        if "401" in str(exc).split("Response body")[0]:
            raise TrackingError(
                f"tracking.uri {uri!r}: the MLflow server refused the login (401): "
                "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
            ) from None
        raise TrackingError(f"tracking.uri {uri!r}: MLflow tracking store unusable: {type(exc).__name__}: {exc}") from None


def create_sqlite_store(uri: str) -> None:
    """Create a `sqlite:///` store's database whole or not at all: its schema is built in a
    temporary file that is renamed into place, under a lock, so a kill during creation leaves no
    half-migrated database and two runs starting at once do not migrate it twice."""
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri.removeprefix("sqlite:///"))
    if db.exists():
        return
    with creation_lock(db):
        if db.exists():  # another process created it while we waited
            return
        for stale in db.parent.glob(f".{db.name}.tmp-*"):  # a creator killed before its rename
            stale.unlink()
        tmp = db.with_name(f".{db.name}.tmp-{os.getpid()}")
        try:
            MlflowClient(f"sqlite:///{tmp.as_posix()}").search_experiments(max_results=1)  # builds the schema
            kill_point("tracking_store")
            os.replace(tmp, db)
        finally:
            tmp.unlink(missing_ok=True)


def open_parent_run(
    ctx: TrackingContext, run_name: str, config: dict[str, Any], resolved: dict[str, str] | None = None
) -> str:
    """Continue the unfinished parent run of the same config, or start a new one (params: the
    flattened resolved config and `resolved`, what `auto` settings became on this machine, as
    `resolved.NAME`; artifact: the resolved YAML)."""
    client = MlflowClient(ctx.uri)
    runs = client.search_runs(
        [ctx.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = 'true' and tags.`{CONFIG_HASH_TAG}` = '{ctx.config_hash}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if runs and runs[0].info.status != RunStatus.to_string(RunStatus.FINISHED):
        run_id = runs[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "prefect.flow_run_id", ctx.flow_run_id)
        return run_id
    run = client.create_run(
        ctx.experiment_id,
        run_name=run_name,
        tags={
            PARENT_TAG: "true",
            CONFIG_HASH_TAG: ctx.config_hash,
            "prefect.flow_run_id": ctx.flow_run_id,
            "rlhf.code_version": code_version(),
        },
    )
    _log_params(client, run.info.run_id, flatten(config) | {f"resolved.{k}": v for k, v in (resolved or {}).items()})
    client.log_text(run.info.run_id, yaml.safe_dump(config, sort_keys=False), "config.resolved.yaml")
    return run.info.run_id


def code_version() -> str:
    """Package version plus the git commit of the checkout when there is one."""
    from ppo_core import __version__

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{__version__}+{commit}" if commit else __version__


def close_parent_run(ctx: TrackingContext, failed: bool) -> None:
    if ctx.parent_run_id:
        MlflowClient(ctx.uri).set_terminated(ctx.parent_run_id, status="FAILED" if failed else "FINISHED")


def _log_params(client: MlflowClient, run_id: str, params: dict[str, Any]) -> None:
    items = list(params.items())
    for start in range(0, len(items), 100):
        batch = items[start : start + 100]
        client.log_batch(run_id, params=[mlflow.entities.Param(k, str(v)[:6000]) for k, v in batch])


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


@contextmanager
def stage_run(
    ctx: TrackingContext, stage: str, tags: dict[str, str] | None = None, system_metrics: bool = False
) -> Iterator[str]:
    """A child run of the pipeline's parent run, active in this thread while the stage works.
    `system_metrics` samples CPU/GPU utilisation and memory into the run (GPU stages)."""
    mlflow.set_tracking_uri(ctx.uri)
    all_tags = {"rlhf.stage": stage, "rlhf.cached": "false", "prefect.flow_run_id": ctx.flow_run_id, **(tags or {})}
    with mlflow.start_run(
        experiment_id=ctx.experiment_id,
        run_name=stage,
        parent_run_id=ctx.parent_run_id,
        nested=True,
        tags=all_tags,
        log_system_metrics=system_metrics or None,
    ) as run:
        yield run.info.run_id


def record_cached(ctx: TrackingContext, stage: str, producer_run_id: str | None, summary: dict[str, Any]) -> None:
    """A cached stage is shown as cached, with a link to the run that computed it."""
    client = MlflowClient(ctx.uri)
    run = client.create_run(
        ctx.experiment_id,
        run_name=f"{stage} (cached)",
        tags={
            "mlflow.parentRunId": ctx.parent_run_id,
            "rlhf.stage": stage,
            "rlhf.cached": "true",
            "rlhf.cached_from_run": producer_run_id or "",
            "prefect.flow_run_id": ctx.flow_run_id,
        },
    )
    metrics = {k: float(v) for k, v in summary.items() if isinstance(v, int | float) and math.isfinite(v)}
    for key, value in metrics.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id)


def log_stage_usage(ctx: TrackingContext, stage: str, usage: dict[str, dict[str, float]]) -> None:
    """A stage's resources as parent-run metrics `<kind>/<stage>/<name>`: its peak memory in
    this process (`memory/<stage>/peak_rss_mib`, `.../peak_cuda_mib`: ppo_core.lm.peak_memory)
    and its CPU time (`cpu/<stage>/user_s`, `.../sys_s`: flows.summary.CpuTime); one chart
    compares the stages."""
    now = int(time.time() * 1000)
    metrics = [mlflow.entities.Metric(f"{kind}/{stage}/{key}", value, now, 0)
               for kind, values in usage.items() for key, value in values.items()]
    if not ctx.parent_run_id or not metrics:
        return
    MlflowClient(ctx.uri).log_batch(ctx.parent_run_id, metrics=metrics)


class MetricLogger:
    """The bridge from ppo_core's on_metrics(step, dict) callback to an MLflow run; without a
    run (data-parallel ranks other than 0) it only keeps the history."""

    def __init__(self, run_id: str | None, uri: str) -> None:
        self.run_id = run_id
        self.client = MlflowClient(uri) if run_id else None
        self.history: list[dict[str, float]] = []

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self.history.append({"step": float(step), **clean})
        if self.client is None:
            return
        now = int(time.time() * 1000)
        entities = [mlflow.entities.Metric(k, v, now, step) for k, v in clean.items()]
        for start in range(0, len(entities), 500):
            self.client.log_batch(self.run_id, metrics=entities[start : start + 500])
