"""`rlhf models list / get / promote`: pulling the tiny pipeline's registered models out of the
MLflow Model Registry, on the runs of tests/test_pipeline.py (tests/pipeline_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.pipeline_fixtures")

from tests.pipeline_fixtures import NAMES, Run, run_cli  # noqa: E402

pytest_plugins = ["tests.pipeline_fixtures"]
pytestmark = pytest.mark.slow


def test_models_get_writes_a_loadable_hugging_face_folder(second_run: Run, tmp_path: Path) -> None:
    import torch
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.caching import sha256_tree

    out = tmp_path / "champion"
    proc = run_cli(
        "models",
        "get",
        "tiny-policy@champion",
        "--out",
        str(out),
        "--uri",
        second_run.tracking_uri,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    # The exported weights are the champion version's weights, tensor for tensor.
    champion = MlflowClient(second_run.tracking_uri).get_model_version_by_alias(
        "tiny-policy", "champion"
    )
    policies = [
        p
        for p in (second_run.folder / ".rlhf" / "tiny" / "stages" / "ppo_round").glob("*/policy")
        if sha256_tree(p) == champion.tags["rlhf.sha256"]
    ]
    assert policies, "no PPO round folder holds the champion's weights"
    trained = AutoModelForCausalLM.from_pretrained(policies[0]).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    ids = tokenizer("the movie was", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert (
        generated.shape[1] == ids["input_ids"].shape[1] + 5
        or int(generated[0, -1]) == tokenizer.eos_token_id
    )
    assert tokenizer.decode(
        generated[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
    ).strip()


def test_models_list_shows_versions_and_aliases(second_run: Run, tmp_path: Path) -> None:
    proc = run_cli("models", "list", "--uri", second_run.tracking_uri, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    names = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    assert set(NAMES) <= names
    assert any(
        "champion" in line for line in proc.stdout.splitlines() if line.startswith("tiny-policy")
    )


def test_models_get_never_merges_into_a_folder_and_leaves_no_debris(second_run: Run, tmp_path: Path) -> None:
    out = tmp_path / "policy"
    out.mkdir()
    (out / "model-00002-of-00002.safetensors").write_text("a stale shard of another model")

    def get(*extra: str):
        return run_cli("models", "get", *extra, "--uri", second_run.tracking_uri, cwd=tmp_path)

    refused = get("tiny-policy@champion", "--out", str(out))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: tiny-policy@champion: {out} exists and is not empty; choose another --out or pass --force to replace it"
    ]
    assert sorted(p.name for p in out.iterdir()) == ["model-00002-of-00002.safetensors"]

    missing = get("tiny-policy/99", "--out", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: tiny-policy/99: ")
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr

    replaced = get("tiny-policy@champion", "--out", str(out), "--force")
    assert replaced.returncode == 0, replaced.stderr
    assert (out / "config.json").exists() and not (out / "model-00002-of-00002.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no download or old folders left


def test_models_commands_fail_with_one_error_line(second_run: Run, tmp_path: Path) -> None:
    import time

    def models(*args: str, uri: str = second_run.tracking_uri):
        start = time.perf_counter()
        proc = run_cli("models", *args, "--uri", uri, cwd=tmp_path, timeout=120)
        return proc, time.perf_counter() - start

    for args, prefix in (
        (("list", "no-such-model"), "error: no-such-model: "),
        (("promote", "tiny-policy", "99", "champion"), "error: tiny-policy version 99: "),
    ):
        proc, _ = models(*args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    dead, seconds = models("list", uri="http://127.0.0.1:9")  # nothing listens on the discard port
    assert dead.returncode == 2 and len(dead.stderr.strip().splitlines()) == 1, dead.stderr
    assert dead.stderr.startswith("error: http://127.0.0.1:9: ") and seconds < 60
