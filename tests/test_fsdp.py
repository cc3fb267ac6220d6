"""Sharded data-parallel PPO (`ppo.sharding: fsdp`, ppo_core.lm.sharding): 2 gloo processes with the
policy and the value module sharded by FSDP2 train as one process does on the same samples
(separate critic, and value head on a shared LoRA trunk), hold only their shards, checkpoint with
torch.distributed.checkpoint into the atomic folders, resume exactly after a crash, read and
write the plain layout too, and run the tiny pipeline end to end.

Tolerance of the comparisons with one process: the ranks' partial gradients are summed in another
order than one process accumulates its micro-batches (and the clipping norm from per-shard
partial sums), so the results differ by float32 rounding, as DDP's do (tests/test_distributed.py:
1e-5 absolute on weights of order 0.1-1 after 12 AdamW steps, 1e-4 relative on metrics).
Everything else is bitwise: a resumed sharded run equals the uninterrupted one exactly.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppo_core.lm.checkpoint import (
    MANIFEST,
    CheckpointCorruptError,
    checkpoint_name,
    read_checkpoint,
)
from ppo_core.lm.dcp_checkpoint import DCP_DIR, is_sharded_checkpoint, load_sharded
from tests import dist_worker, fsdp_worker
from tests.pipeline_fixtures import PPO_STAGES, UPSTREAM, Run, run_pipeline

pytest_plugins = ["tests.pipeline_fixtures"]

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = fsdp_worker.ITERATIONS
CRITICS = fsdp_worker.CRITICS
VOLATILE = ("time/", "throughput/")


def torchrun(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """dist_worker's trainer in this process, per critic, checkpointed every iteration (plain)."""
    out = tmp_path_factory.mktemp("fsdp-one-process")
    results = {}
    for critic in CRITICS:
        trainer = dist_worker.build(critic=critic)
        history = []
        while trainer.iteration < ITERATIONS:
            history.append(trainer.step())
            trainer.save(out / critic)
        results[critic] = {
            "history": history, "policy": _clone(trainer.policy.state_dict()),
            "value": _clone(trainer.value_module.state_dict()), "kl_coef": trainer.kl_ctl.value,
            "first_grads": trainer.first_grads, "local_tokens": trainer.local_tokens, "checkpoints": out / critic,
        }
    results["one_sided"] = dist_worker.one_sided_minibatch(None, "separate")
    return results


@pytest.fixture(scope="module")
def sharded(one_process: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The torchrun runs of tests/fsdp_worker.py: train, then (new processes) resume."""
    out = tmp_path_factory.mktemp("fsdp-two-processes")
    torchrun("-m", "tests.fsdp_worker", str(out), "train")
    before_crash = checkpoint_name(ITERATIONS - 1)  # a crash right after this checkpoint
    (out / "crashed").mkdir()
    shutil.copytree(out / "sampled" / before_crash, out / "crashed" / before_crash)
    (out / "crashed" / "latest").write_text(before_crash)
    plain = one_process["separate"]["checkpoints"] / before_crash
    torchrun("-m", "tests.fsdp_worker", str(out), "resume", str(plain))
    return out


def _load(sharded: Path, mode: str, rank: int = 0) -> dict:
    return torch.load(sharded / f"{mode}-rank{rank}.pt", weights_only=False)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _assert_trains_like(got: dict, expected: dict) -> None:
    for it, (m2, m1) in enumerate(zip(got["history"], expected["history"], strict=True)):
        for key in dist_worker.EXACT_KEYS:
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), f"iteration {it + 1}: {key}"
    assert got["kl_coef"] == pytest.approx(expected["kl_coef"], rel=1e-6)
    assert _max_diff(got["policy"], expected["policy"]) < 1e-5
    assert _max_diff(got["value"], expected["value"]) < 1e-5


@pytest.mark.parametrize("critic", CRITICS)
def test_sharded_processes_train_exactly_like_one(critic: str, sharded: Path, one_process: dict) -> None:
    r0, r1 = _load(sharded, "train", 0)[f"fixed-{critic}"], _load(sharded, "train", 1)[f"fixed-{critic}"]
    single = one_process[critic]
    start = dist_worker.build(critic=critic)  # training moved the weights: equality means something
    assert _max_diff(single["policy"], start.policy.state_dict()) > 1e-3
    assert _max_diff(single["value"], start.value_module.state_dict()) > 1e-3
    _assert_trains_like(r0, single)
    assert r0["history"] == r1["history"]  # reduced metrics are the same on every rank
    # the first minibatch's gradient (before clipping) is the one-process gradient, summed over
    # ranks holding unequal token counts: an average would halve it
    assert r0["local_tokens"][0] != r1["local_tokens"][0]
    assert r0["local_tokens"][0] + r1["local_tokens"][0] == single["local_tokens"][0]
    scale = max(g.abs().max().item() for g in single["first_grads"].values())
    assert scale > 1e-3 and _max_diff(r0["first_grads"], single["first_grads"]) < 1e-5 * scale


@pytest.mark.parametrize("critic", CRITICS)
def test_ranks_hold_shards_of_weights_gradients_and_optimizer_state(critic: str, sharded: Path) -> None:
    r0, r1 = _load(sharded, "train", 0)[f"fixed-{critic}"], _load(sharded, "train", 1)[f"fixed-{critic}"]
    for rank in (r0, r1):
        assert rank["all_dtensors"]
        assert rank["local_params"] < 0.6 * rank["params"] and rank["local_moments"] == rank["local_params"]
    assert r0["local_params"] + r1["local_params"] >= r0["params"]  # (shards are padded to equal size)
    # every rank ran as many micro-steps (collectives), each with one reduce-scatter
    assert r0["micro_steps"] == r1["micro_steps"] == r0["reductions"] == r1["reductions"]


def test_a_rank_without_rows_of_a_minibatch_joins_with_zero_weight_steps(sharded: Path, one_process: dict) -> None:
    r0, r1 = (_load(sharded, "train", r)["one_sided"] for r in (0, 1))
    single = one_process["one_sided"]
    assert r0["micro_steps"] == r1["micro_steps"] == len(dist_worker.ONE_SIDED)
    for key, value in single["stats"].items():
        assert r0["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert _max_diff(r0["policy"], single["policy"]) < 1e-5 and _max_diff(r0["value"], single["value"]) < 1e-5


def test_a_gathered_lora_policy_loads_into_a_plain_peft_model(sharded: Path, one_process: dict) -> None:
    """What flows.workers does to export a sharded policy: its whole state (frozen base included)
    gathered onto rank 0 and loaded into a model built as the trainer's was, then merged."""
    state = _load(sharded, "train")["fixed-shared"]["policy"]
    fresh = dist_worker.lora_policy()
    fresh.load_state_dict(state, strict=True)
    assert _max_diff(fresh.state_dict(), one_process["shared"]["policy"]) < 1e-5
    merged = fresh.merge_and_unload().state_dict()
    assert not any("lora" in k for k in merged) and merged.keys() == dist_worker.tiny_llama(0).state_dict().keys()


def test_sharded_checkpoint_layout(sharded: Path) -> None:
    folder = sharded / "fixed-separate" / checkpoint_name(ITERATIONS)
    assert sorted(p.name for p in folder.parent.iterdir()) == [checkpoint_name(ITERATIONS - 1), folder.name, "latest"]
    assert is_sharded_checkpoint(folder)
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert set(files) == {f"{DCP_DIR}/.metadata", f"{DCP_DIR}/__0_0.distcp", f"{DCP_DIR}/__1_0.distcp",
                          "optim.pt", "rng.pt", "rng_ranks.pt", "trainer.json"}
    assert json.loads((folder / "trainer.json").read_text())["iteration"] == ITERATIONS


def test_a_resumed_sharded_run_equals_the_uninterrupted_one(sharded: Path) -> None:
    """Sampled responses (each rank's own RNG, restored from the checkpoint), LoRA, value head."""
    uninterrupted, resumed = _load(sharded, "train")["sampled"], _load(sharded, "resume")
    assert resumed["loaded"] == str(sharded / "crashed" / checkpoint_name(ITERATIONS - 1))
    [after] = resumed["sampled"]["history"]  # the one iteration after the crash
    assert {k: v for k, v in after.items() if not k.startswith(VOLATILE)} == {
        k: v for k, v in uninterrupted["history"][-1].items() if not k.startswith(VOLATILE)
    }
    assert _max_diff(resumed["sampled"]["policy"], uninterrupted["policy"]) == 0.0
    assert _max_diff(resumed["sampled"]["value"], uninterrupted["value"]) == 0.0
    assert _max_diff(uninterrupted["policy"], dist_worker.build(critic="shared").policy.state_dict()) > 1e-3


def test_one_process_resumes_from_a_sharded_checkpoint(sharded: Path, one_process: dict) -> None:
    """DCP reads 2 ranks' shards into whole tensors (what export and a 1-process resume need)."""
    trainer = dist_worker.build(critic="separate")
    assert trainer.load(sharded / "fixed-separate" / checkpoint_name(ITERATIONS - 1)) is not None
    assert trainer.iteration == ITERATIONS - 1
    trainer.step()
    expected = one_process["separate"]
    assert _max_diff(trainer.policy.state_dict(), expected["policy"]) < 1e-5
    assert _max_diff(trainer.value_module.state_dict(), expected["value"]) < 1e-5


def test_a_sharded_run_resumes_from_a_plain_checkpoint(sharded: Path, one_process: dict) -> None:
    resumed, single = _load(sharded, "resume"), one_process["separate"]
    assert resumed["loaded-plain"] == str(single["checkpoints"] / checkpoint_name(ITERATIONS - 1))
    _assert_trains_like(resumed["from-plain"], {**single, "history": single["history"][-1:]})


def test_a_torn_shard_falls_back_and_a_tampered_index_runs_no_code(sharded: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(sharded / "fixed-separate", root)
    newest = root / checkpoint_name(ITERATIONS)
    shard = newest / DCP_DIR / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])  # torn by a crash (or a full disk)
    with pytest.raises(CheckpointCorruptError, match=r"__1_0\.distcp has size"):
        read_checkpoint(newest)
    trainer = dist_worker.build(critic="separate")
    assert trainer.load(root) == root / checkpoint_name(ITERATIONS - 1)
    marker = tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):
            return (Path.touch, (marker,))

    older = root / checkpoint_name(ITERATIONS - 1)
    index = older / DCP_DIR / ".metadata"
    index.write_bytes(pickle.dumps(RunsCode()))
    manifest = json.loads((older / MANIFEST).read_text())
    manifest["files"][f"{DCP_DIR}/.metadata"] = index.stat().st_size
    (older / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata does not parse: .*refers to pathlib\.Path\.touch"):
        dist_worker.build(critic="separate").load(older)
    assert not marker.exists()


@pytest.fixture(scope="module")
def fsdp_pipeline(pipeline_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The tiny pipeline with ppo.processes=2, ppo.sharding=fsdp, in a folder of its own."""
    return run_pipeline(tmp_path_factory.mktemp("fsdp-pipeline"), ["ppo.processes=2", "ppo.sharding=fsdp"])


def test_pipeline_runs_sharded_and_exports_a_plain_policy(fsdp_pipeline: Run) -> None:
    from transformers import AutoModelForCausalLM

    assert fsdp_pipeline.result is not None, f"sharded run failed: {fsdp_pipeline.error!r}"
    assert all(fsdp_pipeline.stages[s] == "Completed" for s in (*UPSTREAM, *PPO_STAGES))
    folder = Path(fsdp_pipeline.result["policy_path"])
    assert (folder.parent / "job.json").exists()  # the round went through the torchrun launcher
    state = folder.parent / "state"
    latest = state / (state / "latest").read_text()
    assert is_sharded_checkpoint(latest) and read_checkpoint(latest).state["trainer"]["iteration"] == 4
    exported = AutoModelForCausalLM.from_pretrained(folder).state_dict()  # plain transformers
    # the exported weights are the last checkpoint's policy, its 2 ranks' shards read in one process
    target = {"policy": {k: torch.empty_like(v) for k, v in exported.items()}}
    load_sharded(latest, target)
    assert exported.keys() == target["policy"].keys()
    assert all(torch.equal(target["policy"][k], v) for k, v in exported.items())
