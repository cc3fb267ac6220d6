"""The `rlhf` command line."""

from __future__ import annotations

import typer

from ppo_core import __version__

app = typer.Typer(help="Declarative RLHF with PPO: Prefect pipelines, MLflow tracking.", no_args_is_help=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rlhf {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """RLHF with PPO on causal language models."""
if __name__ == "__main__":
    app()
