"""Small helpers shared by the stage tasks: output folders, logging, atomic publishing."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("rlhf")


def stage_dir(work_dir: str | Path, stage: str, key: str) -> Path:
    """Outputs of one stage run live under a folder named by its cache key."""
    folder = Path(work_dir).resolve() / "stages" / stage / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def publish(tmp: Path, final: Path) -> Path:
    """Move a finished output into place in one rename, so readers never see half of it."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def fresh_tmp(final: Path) -> Path:
    tmp = final.with_name(f".{final.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_prompt_file(path: Path, prompts: list[str]) -> Path:
    path.write_text(json.dumps(prompts, ensure_ascii=False, indent=0))
    return path


def read_prompt_file(path: str | Path) -> list[str]:
    return json.loads(Path(path).read_text())
