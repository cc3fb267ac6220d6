"""Small helpers shared by the stage tasks: output folders, logging, prompt files."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from ppo_core.config import DeviceConfig
from ppo_core.lm import placement as lm_placement
from ppo_core.lm.placement import Placement


def logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run's logger inside a flow or task run, else the "rlhf" logger. A process that
    never imported Prefect (a torchrun rank, a Ray Train worker) has no run: it does not import it."""
    if "prefect" in sys.modules:
        from prefect import get_run_logger
        from prefect.exceptions import MissingContextError

        try:
            return get_run_logger()
        except MissingContextError:
            pass
    return logging.getLogger("rlhf")


def placement(device: DeviceConfig) -> Placement:
    """The one device resolver (looked up at call time, so a test can stand in for it)."""
    return lm_placement.resolve_placement(device)


def stage_dir(work_dir: str | Path, stage: str, key: str) -> Path:
    """Outputs of one stage run live under a folder named by its cache key."""
    folder = Path(work_dir).resolve() / "stages" / stage / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_prompt_file(path: Path, prompts: list[str]) -> Path:
    path.write_text(json.dumps(prompts, ensure_ascii=False, indent=0))
    return path


def read_prompt_file(path: str | Path) -> list[str]:
    return json.loads(Path(path).read_text())
