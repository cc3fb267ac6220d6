"""One device resolver for every stage (ppo_core.lm.placement): the tiny pipeline runs with a
recording stand-in for the resolver, and every forward pass of a transformers model, in every
stage, must use parameters that went through the placement it returned. A model loaded and run
without it (as the PPO round's reward model and the preference sampler once were) fails this."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

pytest.register_assert_rewrite("tests.pipeline_fixtures")

from tests.pipeline_fixtures import run_pipeline  # noqa: E402

pytest_plugins = ["tests.pipeline_fixtures"]
pytestmark = pytest.mark.slow


def test_every_stage_runs_its_models_where_the_one_resolver_places_them(
    pipeline_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.context import TaskRunContext

    from ppo_core.lm import placement as lm_placement

    placed: set[int] = set()
    asked: list[tuple[str, str]] = []
    ran: dict[str, list[str]] = {}

    class Recording(lm_placement.Placement):
        def place(self, module):
            out = super().place(module)
            placed.update(id(p) for p in out.parameters())
            return out

    def resolver(cfg):
        context = TaskRunContext.get()
        asked.append((context.task.name if context else "the flow", cfg.device))
        return Recording(torch.device("cpu"))

    def check(module: torch.nn.Module, args: tuple) -> None:
        if isinstance(module, PreTrainedModel):
            context = TaskRunContext.get()
            stage = context.task.name if context else "-"
            unplaced = [n for n, p in module.named_parameters() if id(p) not in placed]
            ran.setdefault(stage, []).append(f"{type(module).__name__}: {len(unplaced)} unplaced")

    monkeypatch.setattr(lm_placement, "resolve_placement", resolver)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(check)
    try:
        run = run_pipeline(tmp_path, ["orchestration.device.device=cpu"])
    finally:
        hook.remove()
    assert run.result is not None, f"the run failed: {run.error!r}"
    # the flow itself asks once, for the resolved device and precision it logs as run params
    assert {stage for stage, _ in asked} == {
        "the flow", "collect_preferences", "train_reward_model", "ppo_round", "evaluate"
    }
    assert {device for _, device in asked} == {"cpu"}  # the config's choice reached the resolver
    assert set(ran) == {"collect_preferences", "train_reward_model", "ppo_round", "evaluate"}
    bad = {stage: sorted({r for r in runs if not r.endswith(": 0 unplaced")}) for stage, runs in ran.items()}
    assert bad == {stage: [] for stage in ran}, bad
