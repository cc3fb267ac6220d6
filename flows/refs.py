"""What stages hand each other: small pydantic references, never model objects.

Each carries the content hash its consumers put into their own cache keys, so a stage
reruns exactly when something it reads has changed.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from ppo_core.lm.checkpoint import sha256_file, sha256_tree


class StageRef(BaseModel):
    """Common fields: where the output lives and its content hash."""

    path: str
    """Local folder or file holding the stage's output."""
    sha256: str
    """Content hash of the output (weights or data)."""
    mlflow_run_id: str | None = None
    """The MLflow run that produced it."""

    def problems(self) -> list[str]:
        """Why the outputs on disk are not the ones this reference names (empty when they
        are): a cached result is trusted only when this is empty."""
        path = Path(self.path)
        if not path.exists():
            return [f"{path} is missing"]
        found = sha256_tree(path) if path.is_dir() else sha256_file(path)
        return [] if found == self.sha256 else [f"{path} has sha256 {found[:12]}, recorded {self.sha256[:12]}"]


class PreferenceSet(StageRef):
    n_rows: int
    n_read: int
    rejected: dict[str, int] = Field(default_factory=dict)
    rejected_examples: list[str] = Field(default_factory=list)
    train_prompts_path: str
    heldout_prompts_path: str
    seconds: float = 0.0

    def problems(self) -> list[str]:
        prompt_files = (self.train_prompts_path, self.heldout_prompts_path)
        return super().problems() + [f"{p} is missing" for p in prompt_files if not Path(p).is_file()]


class ModelRef(StageRef):
    """A model folder that `from_pretrained` loads, plus its registry entry."""

    model_uri: str | None = None
    """MLflow model URI (models:/NAME/VERSION) when registered."""
    registered_name: str | None = None
    version: str | None = None


class RewardModelRef(ModelRef):
    eval_accuracy: float
    gold_agreement: float | None = None
    norm_gain: float = 1.0
    norm_bias: float = 0.0
    seconds: float = 0.0


class ReferenceRef(ModelRef):
    seconds: float = 0.0


class PolicyCheckpoint(ModelRef):
    round: int
    iteration: int
    state_path: str
    """Trainer checkpoint (policy, critic, optimisers, RNG, KL controller) the next round resumes."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Last iteration's metrics."""
    seconds: float = 0.0

    def problems(self) -> list[str]:
        """The exported policy, and the trainer state the next round continues from."""
        state = [] if Path(self.state_path).is_dir() else [f"{self.state_path} is missing"]
        return super().problems() + state


class EvalRef(StageRef):
    """The evaluation report's JSON file and its headline numbers."""

    champion: bool
    champion_round: int | None = None
    """The round aliased `champion` (evaluation.gates.promote picks final or best round)."""
    champion_model_uri: str | None = None
    gate_reasons: list[str] = Field(default_factory=list)
    headline: dict[str, float | None] = Field(default_factory=dict)
    plot_path: str | None = None
    seconds: float = 0.0
