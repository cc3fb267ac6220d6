"""`rlhf deploy`: put the pipeline on a cron schedule on a Prefect server.

Schedules live in a Prefect server's database; the ephemeral API that `rlhf run` starts lives
only as long as one command, so a schedule there would silently never fire. We refuse that
case with instructions instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prefect.settings import PREFECT_API_URL

from flows.config import PipelineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_WORK_POOL = "gpu"
"""The work pool docker/compose.yaml creates and its worker serves (tests/test_docker.py checks)."""
NEEDS_SERVER = (
    "scheduling needs a Prefect server, and PREFECT_API_URL is not set (only the ephemeral API is available, "
    "which lives as long as one command). Start one with `prefect server start` (or `docker compose -f "
    "docker/compose.yaml up -d`), then `export PREFECT_API_URL=http://127.0.0.1:4200/api` and run this again."
)


class SchedulingError(RuntimeError):
    """No server to hold the schedule, or the server did not answer."""


def _check_server() -> str:
    url = PREFECT_API_URL.value()
    if not url:
        raise SchedulingError(NEEDS_SERVER)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is not None:
        raise SchedulingError(f"Prefect server at {url} did not answer: {error}")
    return url


def schedule(cfg: PipelineConfig, cron: str, name: str, work_pool: str | None, echo: Callable[[str], None]) -> None:
    url = _check_server()
    from flows.pipeline import rlhf_pipeline

    parameters = {"config": cfg.model_dump(mode="json")}
    if work_pool:
        source = rlhf_pipeline.from_source(source=str(REPO_ROOT), entrypoint="flows/pipeline.py:rlhf_pipeline")
        deployment_id = source.deploy(name=name, work_pool_name=work_pool, cron=cron, parameters=parameters)
        echo(f"deployed {name!r} to work pool {work_pool!r} on {url} with cron {cron!r} (id {deployment_id})")
        return
    echo(f"serving {name!r} on {url} with cron {cron!r}; Ctrl-C stops it")
    rlhf_pipeline.serve(name=name, cron=cron, parameters=parameters)
