"""Every shipped pipeline config validates, and the default one names installed model files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flows.config import load_config
from ppo_core.lm.models import resolve_source

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_configs_to_check() -> None:
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "default.yaml", "gpu-hh.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RLHF_TINY_DIR", str(tmp_path / "tiny"))
    cfg = load_config(path)
    assert cfg.ppo.algo.total_iterations == cfg.ppo.rounds * cfg.ppo.iterations_per_round


def test_default_config_uses_the_offline_packages() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
    policy = resolve_source(cfg.model.source)
    assert policy.gguf_file and policy.gguf_file.endswith(".gguf") and policy.hub_id is None
    reward = resolve_source(cfg.reward_model.backbone)
    assert reward.path is not None and (reward.path / "config.json").is_file() and reward.hub_id is None
    assert cfg.evaluation.gold_scorer == "vader" and cfg.evaluation.gates.max_kl is not None


def test_deploy_without_a_prefect_server_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "PREFECT_API_URL"}
    env["RLHF_TINY_DIR"] = str(tmp_path / "tiny")
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "deploy", str(config), "--cron", "0 3 * * *"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs a Prefect server" in result.stderr and "PREFECT_API_URL" in result.stderr
    assert "Traceback" not in result.stderr
