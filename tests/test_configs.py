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
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "default.yaml", "gpu-hh.yaml", "gpu-7b-lora.yaml"}


HUB_MODELS = ("HuggingFaceTB/SmolLM2-360M-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct")


def _cache_model(cache: Path, hub_id: str) -> None:
    """What `hf download` leaves in the Hugging Face cache, config only."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RLHF_TINY_DIR", str(tmp_path / "tiny"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for hub_id in HUB_MODELS:  # the GPU configs' models, as if downloaded
        _cache_model(tmp_path / "hub", hub_id)
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


def test_a_hub_model_that_cannot_be_loaded_is_a_config_error_naming_the_field(tmp_path: Path, monkeypatch) -> None:
    """Offline, a hub id must be in the local cache; online, the hub must know it. Asked of a
    local HTTP server standing in for the hub (HF_ENDPOINT), as huggingface_hub asks the real one."""
    import http.server
    import threading

    from flows.config import ConfigError

    gpu = Path(__file__).resolve().parents[1] / "configs" / "gpu-hh.yaml"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as offline:
        load_config(gpu)
    missing = ("HuggingFaceTB/SmolLM2-360M-Instruct: not in the local Hugging Face cache and HF_HUB_OFFLINE=1; "
               "download it where there is network (hf download HuggingFaceTB/SmolLM2-360M-Instruct) or name a local folder")
    assert offline.value.problems == [f"model.source: {missing}", f"reward_model.backbone: {missing}"]

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            known = self.path.startswith("/api/models/HuggingFaceTB/SmolLM2-360M-Instruct")
            body = b'{"id": "HuggingFaceTB/SmolLM2-360M-Instruct", "sha": "abc123"}' if known else b"{}"
            self.send_response(200 if known else 404)
            if not known:
                self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        import huggingface_hub.constants

        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert load_config(gpu).model.source == "HuggingFaceTB/SmolLM2-360M-Instruct"  # the hub knows it
        with pytest.raises(ConfigError) as typo:
            load_config(gpu, ["model.source=HuggingFaceTB/SmolLM2-306M-Instruct"])
        assert typo.value.problems == [
            "model.source: HuggingFaceTB/SmolLM2-306M-Instruct: no such model on the hub (a typo? a private model needs HF_TOKEN)"
        ]
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: unknown, the load will tell
        assert load_config(gpu).model.source == "HuggingFaceTB/SmolLM2-360M-Instruct"
    finally:
        server.shutdown()


def test_the_7b_config_trains_adapters_sharded_over_a_node() -> None:
    """README "Running a 1B-8B model" starts from this file: what it promises is what it sets."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpu-7b-lora.yaml", check_files=False)
    assert cfg.ppo.lora is not None and cfg.ppo.lora.target_modules == "all-linear"
    assert (cfg.ppo.processes, cfg.ppo.sharding, cfg.ppo.algo.critic) == (8, "fsdp", "shared")
    assert cfg.orchestration.device.gradient_checkpointing and cfg.orchestration.device.device == "cuda"
    assert cfg.ppo.algo.batch_size % cfg.ppo.processes == 0


def test_a_shared_value_head_with_a_reward_model_critic_init_is_an_error_naming_both_fields(tmp_path: Path, monkeypatch) -> None:
    from flows.config import ConfigError

    monkeypatch.setenv("RLHF_TINY_DIR", str(tmp_path / "tiny"))
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(tiny, ["ppo.algo.critic=shared", "ppo.critic_init=reward_model"])
    assert err.value.problems == [
        "ppo.algo: critic: shared puts the value head on the policy's trunk, so ppo.critic_init: "
        "reward_model would be ignored; use critic: separate or drop critic_init"
    ]
    assert load_config(tiny, ["ppo.algo.critic=separate", "ppo.critic_init=reward_model"]).ppo.critic_init == "reward_model"
