"""The MLflow Model Registry: register, tag with lineage, alias, find, export.

Models are logged with the transformers flavor from the already loaded components (logging
by checkpoint path breaks inside mlflow 3.17 with transformers 5), with an explicit
signature and pip requirements so mlflow neither runs the model nor scans the environment.
Registration is idempotent: a version whose `rlhf.sha256` tag matches is reused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib.metadata import version as pkg_version
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, Schema

from flows.faults import kill_point

SHA_TAG = "rlhf.sha256"
SIGNATURES = {
    "text-generation": ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")])),
    "text-classification": ModelSignature(
        inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string", "label"), ColSpec("double", "score")])
    ),
}


def pip_requirements() -> list[str]:
    return [f"{name}=={pkg_version(name)}" for name in ("torch", "transformers", "safetensors", "tokenizers")]


def find_version(client: MlflowClient, name: str, sha256: str) -> Any | None:
    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except mlflow.exceptions.MlflowException:
        return None
    for mv in versions:
        if mv.tags.get(SHA_TAG) == sha256:
            return mv
    return None


def register_model(
    uri: str,
    name: str,
    model: Any,
    tokenizer: Any,
    task: str,
    sha256: str,
    tags: dict[str, str],
    aliases: tuple[str, ...] = (),
) -> tuple[str, str]:
    """Log `model` in the active run and register it as `name`; return (models:/ URI, version).

    The content hash is the version's identity: a version with the same `rlhf.sha256` is reused,
    and a new version is created with its hash and lineage tags in the same call, so a crash can
    leave at most a logged model that no version points to (never an untagged version). Two
    runs registering the same content at once both create a version; the lower one is kept and
    the other deleted."""
    client = MlflowClient(uri)
    existing = find_version(client, name, sha256)
    all_tags = {SHA_TAG: sha256, **tags}
    if existing is None:
        info = mlflow.transformers.log_model(
            transformers_model={"model": model, "tokenizer": tokenizer},
            name="model",
            task=task,
            signature=SIGNATURES[task],
            pip_requirements=pip_requirements(),
        )
        kill_point("register")
        created = mlflow.register_model(info.model_uri, name, tags={k: str(v) for k, v in all_tags.items()})
        version = _keep_first(client, name, sha256, str(created.version))
    else:
        version = str(existing.version)
        for key, value in all_tags.items():
            client.set_model_version_tag(name, version, key, str(value))
    for alias in aliases:
        client.set_registered_model_alias(name, alias, version)
    return f"models:/{name}/{version}", version


def _keep_first(client: MlflowClient, name: str, sha256: str, created: str) -> str:
    """The lowest version holding `sha256`; `created` is deleted when a concurrent run got there first."""
    same = sorted(int(mv.version) for mv in client.search_model_versions(f"name = '{name}'") if mv.tags.get(SHA_TAG) == sha256)
    first = str(same[0]) if same else created
    if first != created:
        client.delete_model_version(name, created)
    return first


def set_alias(uri: str, name: str, version: str, alias: str) -> None:
    MlflowClient(uri).set_registered_model_alias(name, alias, version)


def list_models(uri: str, name: str | None = None) -> list[dict[str, Any]]:
    """Versions with aliases, lineage tags and their run's headline metrics."""
    client = MlflowClient(uri)
    models = [client.get_registered_model(name)] if name else client.search_registered_models()
    rows = []
    for rm in models:
        aliases_by_version: dict[str, list[str]] = {}
        for alias, ver in (rm.aliases or {}).items():
            aliases_by_version.setdefault(str(ver), []).append(alias)
        for mv in client.search_model_versions(f"name = '{rm.name}'"):
            metrics = client.get_run(mv.run_id).data.metrics if mv.run_id else {}
            rows.append(
                {
                    "name": rm.name,
                    "version": str(mv.version),
                    "aliases": aliases_by_version.get(str(mv.version), []),
                    "tags": dict(mv.tags),
                    "metrics": metrics,
                }
            )
    return sorted(rows, key=lambda r: (r["name"], int(r["version"])))


def model_uri(spec: str) -> str:
    """NAME@ALIAS or NAME/VERSION -> models:/ URI."""
    return spec if spec.startswith("models:/") else f"models:/{spec}"


class ExportError(RuntimeError):
    """`rlhf models get` cannot write where it was asked to; nothing was written."""


def export_hf_folder(uri: str, spec: str, out: str | Path, force: bool = False) -> Path:
    """Download a registered transformers model as a plain Hugging Face folder (weights,
    config, tokenizer) that `from_pretrained(out)` loads without mlflow.

    The folder is assembled beside `out` and renamed into place, so `out` is either the whole
    model or untouched, and a failed download leaves nothing behind. An existing non-empty
    `out` is replaced only with `force` (never merged: stale shards would load beside new ones).
    """
    out = Path(out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"{out} exists and is not empty; choose another --out or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.download-", dir=out.parent))
    try:
        mlflow.set_tracking_uri(uri)
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri(spec), dst_path=str(staging / "artifacts")))
        folder = staging / "model"
        folder.mkdir()
        for sub in (local / "model", local / "components" / "tokenizer"):
            if sub.is_dir():
                for item in sub.iterdir():
                    shutil.copy2(item, folder / item.name) if item.is_file() else shutil.copytree(item, folder / item.name)
        if not (folder / "config.json").exists():
            raise ExportError(f"{spec}: the registered model has no config.json (not a transformers model?)")
        _replace(folder, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _replace(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an existing `out` is moved aside first and deleted last."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
