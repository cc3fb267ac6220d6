"""ppo_core is a library: it must never import the orchestrator or the tracker."""

from __future__ import annotations

import ast
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


def test_importing_ppo_core_loads_neither_at_runtime() -> None:
    code = (
        "import sys, ppo_core, ppo_core.ppo.trainer, ppo_core.lm.rollout;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('prefect','mlflow')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cli_version() -> None:
    result = subprocess.run([sys.executable, "-m", "flows.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("rlhf "), result.stdout + result.stderr
