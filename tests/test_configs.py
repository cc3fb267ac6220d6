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
    assert cfg.ppo.effective_algo.total_iterations == cfg.ppo.rounds * cfg.ppo.iterations_per_round


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


def test_the_lr_schedule_spans_the_run_and_is_derived_not_rewritten() -> None:
    """ppo.algo.total_iterations is rounds x iterations_per_round: derived for the trainer, a
    different hand-set value is an error naming the field, and the config as the user wrote it
    (and as it round-trips through the flow's parameters) is left as it was."""
    from flows.config import ConfigError, PipelineConfig

    default = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    cfg = load_config(default, ["ppo.rounds=3", "ppo.iterations_per_round=5"])
    assert cfg.ppo.total_iterations == 15 and cfg.ppo.effective_algo.total_iterations == 15
    assert "total_iterations" not in cfg.ppo.algo.model_fields_set
    assert PipelineConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    assert load_config(default, ["ppo.rounds=3", "ppo.iterations_per_round=5", "ppo.algo.total_iterations=15"])
    with pytest.raises(ConfigError) as err:
        load_config(default, ["ppo.rounds=3", "ppo.iterations_per_round=5", "ppo.algo.total_iterations=7"])
    assert err.value.problems == [
        "ppo.algo: total_iterations (7) is derived in a pipeline: ppo.rounds x ppo.iterations_per_round = 15; remove it"
    ]


@pytest.mark.parametrize(
    ("mini", "current", "expected"),
    [(8, 8, 4), (8, 4, 2), (8, 1, None), (12, 12, 6), (12, 6, 3), (9, 9, 3), (10, 5, 2), (7, 7, 1)],
)
def test_out_of_memory_retry_picks_a_micro_batch_that_divides_the_minibatch(mini: int, current: int, expected: int | None) -> None:
    """Halving 9 would give 4, which does not divide 9: accumulation would then drop a row."""
    from flows.launchers import smaller_micro_batch

    assert smaller_micro_batch(mini, current) == expected
