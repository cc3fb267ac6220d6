"""`rlhf models ...`: list, export and promote registered models."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer

from flows.runtime import configure_environment

models_app = typer.Typer(help="Registered models in the MLflow Model Registry.", no_args_is_help=True)
URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///./mlflow.db)."


def _uri(uri: str | None) -> str:
    configure_environment(os.environ.get("RLHF_WORK_DIR", ".rlhf"))
    from flows.tracking import default_tracking_uri, fail_fast_over_http

    fail_fast_over_http()

    return uri or default_tracking_uri(Path.cwd())


def _fail(what: str, exc: Exception) -> NoReturn:
    """One `error: ...` line (the first line of the exception's message) and exit code 2."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    typer.echo(f"error: {what}: {lines[0] if lines else type(exc).__name__}", err=True)
    raise typer.Exit(2) from None


@models_app.command("list")
def list_(name: str = typer.Argument(None), uri: str = typer.Option(None, help=URI_HELP)) -> None:
    """Versions, aliases and key metrics (all registered models, or NAME's versions)."""
    from flows.registry import list_models

    uri = _uri(uri)
    try:
        rows = list_models(uri, name)
    except Exception as exc:
        _fail(name or uri, exc)
    if not rows:
        typer.echo("no registered models")
    for row in rows:
        aliases = ",".join(row["aliases"]) or "-"
        keys = ("eval_accuracy", "gold_agreement", "objective/scores", "objective/kl", "gold_reward", "kl_exact")
        metrics = " ".join(f"{k}={row['metrics'][k]:.4g}" for k in keys if k in row["metrics"])
        sha = row["tags"].get("rlhf.sha256", "")[:12]
        typer.echo(f"{row['name']:<28} v{row['version']:<4} {aliases:<20} sha={sha} {metrics}")


@models_app.command()
def get(
    spec: str = typer.Argument(..., help="NAME@ALIAS or NAME/VERSION"),
    out: Path = typer.Option(..., "--out", help="Folder to write a plain Hugging Face model to."),
    uri: str = typer.Option(None, help=URI_HELP),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out folder."),
) -> None:
    """Export a registered model as a folder that AutoModel*.from_pretrained(DIR) loads."""
    from flows.registry import export_hf_folder

    try:
        folder = export_hf_folder(_uri(uri), spec, out, force=force)
    except Exception as exc:
        _fail(spec, exc)
    typer.echo(f"wrote {folder}")


@models_app.command()
def promote(name: str, version: str, alias: str, uri: str = typer.Option(None, help=URI_HELP)) -> None:
    """Point ALIAS (e.g. champion) at VERSION of NAME."""
    from flows.registry import set_alias

    try:
        set_alias(_uri(uri), name, version, alias)
    except Exception as exc:
        _fail(f"{name} version {version}", exc)
    typer.echo(f"{name}@{alias} -> version {version}")
