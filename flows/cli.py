"""The `rlhf` command line: validate, run, resume, stages, deploy, models.

Config problems print one `field.path: reason` line each and exit with code 2 before any
model or orchestrator is loaded (prefect and mlflow are imported only after validation).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import typer

from flows.cli_models import models_app
from flows.runtime import configure_environment
from ppo_core import __version__

app = typer.Typer(help="Declarative RLHF with PPO: Prefect pipelines, MLflow tracking.", no_args_is_help=True)
app.add_typer(models_app, name="models")

SET_HELP = "Override a config value: section.key=value (repeatable)."


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rlhf {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """RLHF with PPO on causal language models."""


def _load(config: Path, overrides: list[str] | None) -> Any:
    from flows.config import ConfigError, load_config

    try:
        return load_config(config, overrides or [])
    except ConfigError as err:
        for line in err.problems:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2) from None


def _memory_plan(cfg: Any, prompt_tokens: int | None, cuda: bool) -> tuple[Any, str]:
    """The PPO round's estimated peak per device (ppo_core.ppo.memory), from weightless skeletons
    and the dtypes the round gives the models: the frozen ones in the compute precision, the
    trained ones too (bf16 weights with fp32 masters), but sharded they stay fp32 on the CPU."""
    import torch

    from ppo_core.lm.models import model_skeleton
    from ppo_core.lm.precision import resolve_precision
    from ppo_core.ppo.memory import estimate_ppo_memory, prompt_tokens_of, reward_skeletons

    how = "--prompt-tokens"
    if prompt_tokens is None:
        prompt_tokens, how = prompt_tokens_of(cfg.prompts)
    ppo, device = cfg.ppo, cfg.orchestration.device
    try:
        bf16 = resolve_precision(device.precision, torch.device("cuda" if cuda else "cpu"))[0] == torch.bfloat16
    except ValueError:  # bf16 asked of a GPU without it: the round says so; estimate fp32
        bf16 = False
    fsdp = ppo.sharding == "fsdp"
    reward, backbone = reward_skeletons(cfg.reward_model.backbone, cfg.reward_model.trust_remote_code)
    estimate = estimate_ppo_memory(
        model_skeleton(cfg.reference_source, cfg.model.trust_remote_code), reward, ppo.effective_algo,
        ppo.sampling, prompt_tokens, lora=ppo.lora, processes=ppo.processes, shards=ppo.processes if fsdp else 1,
        critic_backbone=backbone if ppo.critic_init == "reward_model" else None,
        frozen_dtype_bytes=2 if bf16 else 4, compute_dtype_bytes=2 if bf16 and (cuda or not fsdp) else 4,
        gradient_checkpointing=device.gradient_checkpointing,
    )
    return estimate, f"prompt <= {prompt_tokens} tokens ({how}) + {ppo.sampling.max_new_tokens} new"


@app.command()
def validate(
    config: Path,
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    prompt_tokens: int = typer.Option(None, "--prompt-tokens", min=1, help="Longest prompt in tokens, for the memory estimate."),
) -> None:
    """Check a pipeline config without loading any model, and estimate a PPO round's peak memory."""
    cfg = _load(config, set_)
    typer.echo(f"{config}: OK (pipeline {cfg.name!r}, {cfg.ppo.rounds} PPO rounds x {cfg.ppo.iterations_per_round} iterations)")
    import torch

    from ppo_core.ppo.memory import format_bytes, format_estimate

    cuda = torch.cuda.is_available() and cfg.orchestration.device.device != "cpu"
    try:
        estimate, prompt = _memory_plan(cfg, prompt_tokens, cuda)
    except (OSError, ValueError, KeyError, AttributeError) as exc:  # a model transformers cannot build empty
        typer.echo(f"memory estimate: not available ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        return
    typer.echo(f"estimated peak per device for a PPO round ({'CUDA' if cuda else 'CPU'}, {prompt}):")
    typer.echo(format_estimate(estimate))
    available = torch.cuda.get_device_properties(0).total_memory if cuda else None
    if available is not None and estimate.total > available:
        typer.echo(f"error: ppo: the estimated peak of {format_bytes(estimate.total)} per device exceeds the GPU's "
                   f"{format_bytes(available)}; change ppo.algo.micro_batch_size, "
                   "orchestration.device.gradient_checkpointing, ppo.lora or ppo.processes (with ppo.sharding: fsdp)", err=True)
        raise typer.Exit(2)


def _print_result(result: dict[str, Any]) -> None:
    typer.echo("")
    for stage, status in result["stages"].items():
        typer.echo(f"  {stage:<22} {status}")
    typer.echo("")
    promoted = f" (round {result['champion_round']})" if result.get("champion") and result.get("champion_round") else ""
    typer.echo(f"Champion promoted: {result['champion']}{promoted}")
    if result.get("resolved"):
        typer.echo(f"Device: {result['resolved']['device']}, {result['resolved']['precision_reason']}")
    for label in ("reference_uri", "reward_model_uri", "policy_uri", "champion_uri"):
        if result.get(label):
            typer.echo(f"{label.replace('_uri', '').replace('_', ' '):<13} {result[label]}")
    typer.echo(f"Final policy: {result['policy_path']}   (sha256 {result['policy_sha256']})")
    typer.echo(f"Evaluation report: {result['report_path']}")
    typer.echo(f"MLflow UI: mlflow ui --backend-store-uri {result['mlflow_uri']}   (parent run {result['mlflow_parent_run_id']})")
    typer.echo(f"Prefect flow run: {result['flow_run_id']}   (prefect flow-run inspect {result['flow_run_id']})")


def _run_flow(config_dict: dict[str, Any], force: list[str] | None) -> dict[str, Any]:
    from flows.pipeline import rlhf_pipeline

    return rlhf_pipeline(config=config_dict, force=force or None)


def _check_work_dir(work_dir: str) -> None:
    """A work folder that cannot be written is reported now, in one line, before Prefect (whose
    home lives in it) starts."""
    try:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=work_dir):
            pass
    except OSError as exc:
        typer.echo(f"error: orchestration.work_dir: {work_dir} is not a writable folder ({exc.strerror or exc})", err=True)
        raise typer.Exit(2) from None


def _check_prefect() -> None:
    """A Prefect server (PREFECT_API_URL) that does not answer or refuses the login is one
    line now, before any model is loaded; without one the ephemeral API starts with the flow."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    try:
        with get_client(sync_client=True) as client:
            client.read_flows(limit=1)
    except Exception as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        reason = (
            f"the Prefect server refused the login ({status}): set PREFECT_API_AUTH_STRING=user:password"
            if status in (401, 403) else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
        typer.echo(f"error: PREFECT_API_URL {url}: {reason}", err=True)
        raise typer.Exit(2) from None


def _check_tracking(cfg: Any) -> None:
    """An unusable tracking store is reported now, before Prefect starts (the ephemeral API alone
    takes tens of seconds) and long before any training; the flow checks again for deployments."""
    from flows.tracking import connect, default_tracking_uri

    uri = cfg.tracking.uri or default_tracking_uri(Path.cwd())
    connect(uri, cfg.tracking.experiment or cfg.name, Path.cwd() / "mlruns")


DEBUG_HELP = "Show tracebacks on the console (they are always in the run's log file)."


@app.command()
def run(
    config: Path,
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    force: list[str] = typer.Option(None, "--force", help="Recompute this stage and everything downstream."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Run the pipeline; finished stages come from the cache, a failed run resumes."""
    cfg = _load(config, set_)
    _check_work_dir(cfg.orchestration.work_dir)
    configure_environment(cfg.orchestration.work_dir)
    from flows.caching import STAGES

    bad = [s for s in force or [] if s not in STAGES]
    if bad:
        typer.echo(f"error: --force: unknown stage(s) {bad}; stages are {', '.join(STAGES)}", err=True)
        raise typer.Exit(2)
    _print_result(_run_reporting_errors(cfg, force, debug))


def _run_reporting_errors(cfg: Any, force: list[str] | None, debug: bool) -> dict[str, Any]:
    """Run the flow under the work folder's lock with a run log; a failure ends in one
    `error:` line and the log's path (exit 1; 2 for a busy folder or an unusable store)."""
    from flows.locks import WorkFolderBusy, work_folder_lock
    from flows.logs import one_line, open_run_log
    from flows.pipeline import pipeline_work_dir
    from flows.tracking import TrackingError

    work_dir = pipeline_work_dir(cfg)
    _check_prefect()
    try:
        _check_tracking(cfg)
        with work_folder_lock(work_dir):  # checked before Prefect starts; the flow re-enters it
            log_path = open_run_log(work_dir / "logs", debug)
            try:
                return _run_flow(cfg.model_dump(mode="json"), force)
            except Exception as exc:
                if debug:
                    raise
                typer.echo(f"error: {one_line(exc)}", err=True)
                typer.echo(f"details: {log_path} (or run again with --debug)", err=True)
                raise typer.Exit(1) from None
    except (TrackingError, WorkFolderBusy) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


@app.command()
def resume(flow_run_id: str, debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP)) -> None:
    """Rerun a (failed) flow run's parameters: finished stages are cached, the rest resumes."""
    configure_environment(os.environ.get("RLHF_WORK_DIR", ".rlhf"))
    from prefect.client.orchestration import get_client

    from flows.config import PipelineConfig

    with get_client(sync_client=True) as client:
        try:
            flow_run = client.read_flow_run(flow_run_id)
        except Exception as exc:
            typer.echo(f"error: flow run {flow_run_id}: {exc}", err=True)
            raise typer.Exit(2) from None
    params = flow_run.parameters
    typer.echo(f"resuming flow run {flow_run_id} ({flow_run.name}, state {flow_run.state_name})")
    cfg = PipelineConfig.model_validate(params["config"])
    _print_result(_run_reporting_errors(cfg, params.get("force"), debug))


@app.command()
def stages(config: Path, set_: list[str] = typer.Option(None, "--set", help=SET_HELP)) -> None:
    """Each stage's cache key and whether a cached result exists."""
    cfg = _load(config, set_)
    configure_environment(cfg.orchestration.work_dir)
    from flows.stage_status import stage_table

    for row in stage_table(cfg):
        typer.echo(f"{row['stage']:<22} {row['status']:<8} {row['key']}")


@app.command()
def deploy(
    config: Path,
    cron: str = typer.Option(..., help='Cron schedule, e.g. "0 3 * * *".'),
    name: str = typer.Option(None, help="Deployment name (default: the pipeline name)."),
    work_pool: str = typer.Option(
        None, "--work-pool", help='Deploy to this work pool instead of serving here (docker/compose.yaml\'s is "gpu").'
    ),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
) -> None:
    """Schedule the pipeline on a Prefect server (serve here, or deploy to a work pool)."""
    cfg = _load(config, set_)
    configure_environment(cfg.orchestration.work_dir)
    _check_prefect()
    from flows.schedule import SchedulingError, schedule

    try:
        schedule(cfg, cron, name or cfg.name, work_pool, echo=typer.echo)
    except SchedulingError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
