"""ppo_core is a library: it must never import the orchestrator or the tracker."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PPO_CORE = Path(__file__).resolve().parents[1] / "ppo_core"
FORBIDDEN = {"prefect", "mlflow", "flows"}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_module_under_ppo_core_imports_prefect_or_mlflow() -> None:
    files = sorted(PPO_CORE.rglob("*.py"))
    assert len(files) > 5, "ppo_core looks empty: the scan would prove nothing"
    offenders = {str(f.relative_to(PPO_CORE)): sorted(_imported_roots(f) & FORBIDDEN) for f in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def _loaded_by(modules: str, roots: tuple[str, ...]) -> list[str]:
    """Which of the top-level packages `roots` a fresh interpreter has loaded after importing
    `modules` (a comma-separated import list)."""
    code = (f"import json, sys, {modules}; "
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(roots)!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_ppo_core_loads_neither_at_runtime() -> None:
    assert _loaded_by("ppo_core, ppo_core.ppo.trainer, ppo_core.lm.rollout", ("prefect", "mlflow")) == []


def test_training_processes_do_not_import_prefect() -> None:
    """A torchrun rank runs flows.workers and a Ray Train worker flows.ray_worker: neither has a
    Prefect run, so neither pays for importing Prefect; and the module Ray imports in its Train
    controller and in each worker before anything runs loads no torch, transformers or MLflow."""
    assert _loaded_by("flows.workers", ("prefect",)) == []
    assert _loaded_by("flows.ray_worker", ("prefect", "torch", "transformers", "mlflow")) == []
    # the check can fail: the launcher, in the Prefect task's process, loads torch through flows.workers
    assert _loaded_by("flows.ray_launcher", ("prefect", "torch")) == ["torch"]


def test_cli_version() -> None:
    result = subprocess.run([sys.executable, "-m", "flows.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("rlhf "), result.stdout + result.stderr


# ---- the layout: packages by concern, imports pointing down, no cycles ----------------------
ROOT = PPO_CORE.parent
PACKAGES = ("ppo_core", "flows")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module of ours that `path` imports anywhere (lazy imports in functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = [f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(f): f for f in files}
    return {name: {m for m in _imports(f) if m in modules and m != name} for name, f in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_modules() -> None:
    graph = _graph()
    assert "ppo_core.ppo.trainer" in graph and "flows.pipeline" in graph
    assert _cycle(graph) is None


def test_a_planted_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_ppo_algorithm_imports_neither_evaluation_nor_the_reward_model() -> None:
    graph = _graph()
    ppo = {name: deps for name, deps in graph.items() if name.startswith("ppo_core.ppo")}
    assert len(ppo) > 5
    offenders = {n: sorted(d for d in deps if d.startswith(("ppo_core.eval", "ppo_core.reward"))) for n, deps in ppo.items()}
    assert {n: d for n, d in offenders.items() if d} == {}


def test_ppo_core_top_level_holds_only_the_package_init_and_shared_config() -> None:
    assert sorted(p.name for p in PPO_CORE.glob("*.py")) == ["__init__.py", "config.py"]
    assert {p.name for p in PPO_CORE.iterdir() if (p / "__init__.py").exists()} == {"lm", "ppo", "data", "reward", "eval"}


def test_no_module_over_400_lines() -> None:
    long = {str(f.relative_to(ROOT)): n for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 400}
    assert long == {}


def test_stage_tasks_take_typed_sections_not_dicts() -> None:
    import typing

    import prefect

    import flows.human
    import flows.stages.evaluate
    import flows.stages.ppo
    import flows.stages.preferences
    import flows.stages.reference
    import flows.stages.reward

    modules = (flows.human, flows.stages.evaluate, flows.stages.ppo, flows.stages.preferences,
               flows.stages.reference, flows.stages.reward)
    tasks = [obj for m in modules for obj in vars(m).values() if isinstance(obj, prefect.Task)]
    assert len(tasks) == 6
    untyped = {
        f"{t.name}.{name}": hint
        for t in tasks
        for name, hint in typing.get_type_hints(t.fn).items()
        if hint is dict or typing.get_origin(hint) is dict
    }
    assert untyped == {}


def test_public_api_is_listed_and_importable() -> None:
    import ppo_core

    assert {"PPOTrainer", "PPOConfig", "KLConfig", "SamplingConfig", "generate"} <= set(ppo_core.__all__)
    for name in ppo_core.__all__:
        assert getattr(ppo_core, name) is not None, name
