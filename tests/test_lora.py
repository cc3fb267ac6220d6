"""LoRA end to end (ppo_core.lm.lora): the tiny pipeline with `ppo.lora`, for each critic
choice, crashed inside round 2 and resumed, ends with exactly the uninterrupted run's policy;
in-round checkpoints hold only adapters and heads; the exported and registered policy is a plain
merged transformers model, with the adapter beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytest.register_assert_rewrite("tests.pipeline_fixtures")

from tests.pipeline_fixtures import Run, run_pipeline  # noqa: E402

pytest_plugins = ["tests.pipeline_fixtures"]
pytestmark = pytest.mark.slow

LORA = ["ppo.lora.r=4", "ppo.lora.alpha=8"]


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def _last_round_checkpoint(run: Run) -> Path:
    state = Path(run.result["policy_path"]).parent / "state"
    return next(p for p in state.iterdir() if p.is_dir() and not p.name.startswith("."))


CRITICS = {
    "shared": ["ppo.algo.critic=shared"],  # the value head on the adapted trunk
    "separate": ["ppo.algo.critic=separate"],  # its own copy of the policy trunk, own adapters
    "separate-from-rm": ["ppo.algo.critic=separate", "ppo.critic_init=reward_model"],  # the RM's trunk
}


@pytest.mark.parametrize("critic", sorted(CRITICS))
def test_a_crashed_lora_run_resumes_to_the_uninterrupted_result(
    pipeline_env: Path, tmp_path_factory: pytest.TempPathFactory, critic: str
) -> None:
    overrides = [*LORA, *CRITICS[critic]]
    whole = run_pipeline(tmp_path_factory.mktemp(f"lora-{critic}"), overrides)
    assert whole.result is not None, f"the LoRA run failed: {whole.error!r}"
    folder = tmp_path_factory.mktemp(f"lora-{critic}-crash")
    crashed = run_pipeline(folder, overrides, fail_at="ppo_round:2:1")
    assert crashed.result is None and "round 2" in str(crashed.error)
    resumed = run_pipeline(folder, overrides)
    assert resumed.result is not None, f"the resumed LoRA run failed: {resumed.error!r}"
    assert resumed.stages["ppo_round_1"] == "Cached" and resumed.stages["ppo_round_2"] == "Completed"
    assert resumed.result["policy_sha256"] == whole.result["policy_sha256"]

    # the in-round checkpoint: adapters (and the value head / critic adapters) only
    checkpoint = _last_round_checkpoint(whole)
    policy_keys = _keys(checkpoint / "policy.safetensors")
    assert policy_keys and all("lora_" in k for k in policy_keys), policy_keys[:5]
    value_keys = _keys(checkpoint / "value.safetensors")
    if critic.startswith("separate"):  # the critic's own adapters and its head, never its frozen backbone
        assert {k.split(".")[0] for k in value_keys} == {"backbone", "head"}
        assert all("lora_" in k for k in value_keys if k.startswith("backbone."))
    sizes = json.loads((checkpoint / "MANIFEST.json").read_text())["files"]
    policy_dir = Path(whole.result["policy_path"])
    full = sum(f.stat().st_size for f in policy_dir.glob("*.safetensors"))
    assert sizes["policy.safetensors"] < full / 5, (sizes, full)

    # the exported policy: a plain model with the adapters merged; the adapter alone beside it
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(policy_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    snapshot = next((whole.folder / ".rlhf" / "tiny" / "stages" / "snapshot_reference").glob("*/model"))
    base = AutoModelForCausalLM.from_pretrained(snapshot)
    # (in the compute precision: bf16 where this CPU has it, ppo_core.lm.precision)
    changed = [n for (n, p), (_, q) in zip(merged.named_parameters(), base.named_parameters(), strict=True)
               if not torch.equal(p, q.to(p.dtype))]
    assert changed and all(any(t in n for t in ("q_proj", "v_proj")) for n in changed), changed
    adapter = policy_dir.parent / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()


def test_the_registered_lora_policy_loads_with_mlflow_transformers(pipeline_env: Path, tmp_path: Path) -> None:
    import mlflow

    run = run_pipeline(tmp_path, [*LORA, "ppo.algo.critic=shared"])
    assert run.result is not None, f"the LoRA run failed: {run.error!r}"
    mlflow.set_tracking_uri(run.tracking_uri)
    pipe = mlflow.transformers.load_model(run.result["policy_uri"])
    assert not any("lora" in name for name, _ in pipe.model.named_parameters())
    client = mlflow.MlflowClient(run.tracking_uri)
    stage_run = next(r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
                     if r.info.run_name == "ppo_round_2")
    assert {a.path for a in client.list_artifacts(stage_run.info.run_id, "adapter")} >= {
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
