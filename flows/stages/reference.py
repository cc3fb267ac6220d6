"""Stage: snapshot the frozen reference policy pi_ref as plain safetensors, hashed and registered."""

from __future__ import annotations

import time

import mlflow
from prefect import task

from flows.caching import key_from_parameters, sha256_tree
from flows.refs import ReferenceRef
from flows.registration import lineage_tags
from flows.registry import register_model
from flows.stages.common import logger, stage_dir
from flows.tracking import TrackingContext, stage_run
from ppo_core.lm.folders import replace_folder, temp_folder_for
from ppo_core.lm.models import load_causal_lm, load_tokenizer


@task(name="snapshot_reference", cache_key_fn=key_from_parameters, persist_result=True)
def snapshot_reference(
    key: str,
    source: str,
    tokenizer_source: str | None,
    trust_remote_code: bool,
    work_dir: str,
    tracking: TrackingContext,
) -> ReferenceRef:
    """Load the base policy once (GGUF is dequantised here) and write it as a normal HF folder.

    Every later stage loads this folder: quick, and every consumer provably reads the same weights.
    """
    start = time.perf_counter()
    log = logger()
    final = stage_dir(work_dir, "snapshot_reference", key) / "model"
    tmp = temp_folder_for(final)
    log.info("snapshotting reference from %s", source)
    model = load_causal_lm(source, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(tokenizer_source or source, trust_remote_code=trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    replace_folder(tmp, final)
    sha = sha256_tree(final)
    ref = ReferenceRef(path=str(final), sha256=sha, seconds=0.0)
    with stage_run(tracking, "snapshot_reference", {"rlhf.sha256": sha}) as run_id:
        ref.mlflow_run_id = run_id
        mlflow.log_params({"source": source, "parameters": sum(p.numel() for p in model.parameters())})
        if tracking.register_models:
            name = f"{tracking.pipeline}-reference"
            ref.model_uri, ref.version = register_model(
                tracking.uri, name, model, tokenizer, "text-generation", sha, lineage_tags(tracking, source=source)
            )
            ref.registered_name = name
        ref.seconds = time.perf_counter() - start
        mlflow.log_metric("seconds", ref.seconds)
    log.info("reference %s (sha256 %s) in %.1fs", final, sha[:12], ref.seconds)
    return ref
