"""Checkpoints (ppo_core.lm.checkpoint, PPOTrainer.state_dict/load_state_dict/save/load): a resumed
run is the same run, a checkpoint is either complete and pointed to by `latest`, or absent, and
reading one back executes no code."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import ppo_core.lm.checkpoint
from ppo_core.lm.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointCorruptError,
    CheckpointWriteError,
    atomic_checkpoint,
    latest_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    write_checkpoint,
)
from ppo_core.lm.tiny import tiny_llama_config
from tests.resume_worker import TOTAL_ITERATIONS, comparable, make_resume_trainer, policy_state

REPO = Path(__file__).resolve().parents[1]

def test_resume_in_a_new_process_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = make_resume_trainer()
    straight_history = straight.train(TOTAL_ITERATIONS)
    straight_weights = policy_state(straight)

    first_half = make_resume_trainer()
    first_half.train(2, checkpoint_dir=tmp_path / "ckpt")
    assert latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "iter-000002"

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.resume_worker",
            str(tmp_path / "ckpt"),
            str(tmp_path / "out"),
            str(TOTAL_ITERATIONS),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    resumed = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert resumed["start"] == 2 and len(resumed["history"]) == 2

    # the schedule and the adaptive KL really moved, so restoring them is being tested
    lrs = [m["lr"] for m in straight_history]
    betas = [m["objective/kl_coef"] for m in straight_history]
    assert len(set(lrs)) == 4 and len(set(betas)) == 4

    for expected, got in zip(straight_history[2:], resumed["history"], strict=True):
        expected, got = comparable(expected), comparable(got)
        assert expected.keys() == got.keys()
        diffs = {
            k: (expected[k], got[k])
            for k in expected
            if not math.isclose(expected[k], got[k], rel_tol=1e-5, abs_tol=1e-6)
        }
        assert diffs == {}

    weights = load_file(str(tmp_path / "out" / "policy.safetensors"))
    assert weights.keys() == straight_weights.keys()
    for key, tensor in straight_weights.items():
        torch.testing.assert_close(weights[key], tensor, atol=1e-6, rtol=0, msg=key)
    # and training did move the weights (the comparison is not between two initialisations)
    initial = policy_state(make_resume_trainer())
    assert max((straight_weights[k] - initial[k]).abs().max().item() for k in initial) > 1e-3


def test_exception_inside_atomic_checkpoint_leaves_no_folder_and_latest_unchanged(
    tmp_path: Path,
) -> None:
    with atomic_checkpoint(tmp_path, "iter-000001") as folder:
        (folder / "weights.bin").write_bytes(b"good")
    assert latest_checkpoint(tmp_path) == tmp_path / "iter-000001"

    # torch.save reports a full disk as "unexpected pos ..."; the error says what happened
    expected = (
        r"could not write checkpoint iter-000002 in .*RuntimeError: disk full\. [0-9.]+ GiB free "
        r"on that disk .*; the last complete checkpoint \(iter-000001\) is intact"
    )
    with (
        pytest.raises(CheckpointWriteError, match=expected),
        atomic_checkpoint(tmp_path, "iter-000002") as folder,
    ):
        (folder / "weights.bin").write_bytes(b"half")
        raise RuntimeError("disk full")

    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000001"}
    assert (tmp_path / LATEST).read_text() == "iter-000001"
    assert (latest_checkpoint(tmp_path) / "weights.bin").read_bytes() == b"good"


def test_failed_trainer_save_keeps_the_previous_checkpoint_loadable(
    tmp_path: Path, monkeypatch
) -> None:
    trainer = make_resume_trainer()
    trainer.train(1, checkpoint_dir=tmp_path)
    saved = policy_state(trainer)

    def broken(*_args, **_kwargs) -> None:
        raise OSError("no space left on device")

    # the documented layout: module weights as safetensors, the rest JSON or weights-only torch.save
    assert {p.name for p in (tmp_path / "iter-000001").iterdir()} == {
        "policy.safetensors", "value.safetensors", "optim.pt", "rng.pt", "trainer.json", MANIFEST
    }

    trainer.step()
    # the disk fills after the weights were written, at the first torch.save (the optimizer state)
    monkeypatch.setattr(ppo_core.lm.checkpoint, "save_state", broken)
    with pytest.raises(CheckpointWriteError, match=r"no space left on device\. [0-9.]+ GiB free"):
        trainer.save(tmp_path)
    monkeypatch.undo()

    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000001"}
    fresh = make_resume_trainer()
    assert fresh.load(tmp_path) == tmp_path / "iter-000001" and fresh.iteration == 1
    for key, tensor in policy_state(fresh).items():
        torch.testing.assert_close(tensor, saved[key], atol=0, rtol=0)


def test_keep_last_prunes_old_checkpoints_and_empty_root_loads_nothing(tmp_path: Path) -> None:
    for i in range(1, 5):
        with atomic_checkpoint(tmp_path, f"iter-{i:06d}", keep_last=2) as folder:
            (folder / "x").write_text(str(i))
    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000003", "iter-000004"}
    assert latest_checkpoint(tmp_path) == tmp_path / "iter-000004"
    assert make_resume_trainer().load(tmp_path / "nothing-here") is None
    prune_checkpoints(tmp_path, keep_last=1)
    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000004"}
    # `latest` survives even when it is not the newest name
    with atomic_checkpoint(tmp_path, "iter-000009", keep_last=None) as folder:
        (folder / "x").write_text("9")
    (tmp_path / LATEST).write_text("iter-000004")
    prune_checkpoints(tmp_path, keep_last=1)
    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000004", "iter-000009"}
    prune_checkpoints(tmp_path / "empty", keep_last=1)  # no checkpoints: nothing to do


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_state_dict_into_a_fresh_trainer_takes_the_same_next_step(critic: str, precision: str) -> None:
    """bf16: the snapshot holds the fp32 masters (ppo_core.lm.precision), so the fresh trainer's
    bf16 weights and masters are those of the running one, and it continues bit for bit."""
    trainer = make_resume_trainer(critic=critic, precision=precision)
    trainer.train(1)
    snapshot = copy.deepcopy(trainer.state_dict())  # live tensors, as nn.Module.state_dict's
    # two steps: the LR schedule's restored position only shows in the second step's LR
    expected = [comparable(trainer.step()) for _ in range(2)]
    expected_weights = {**policy_state(trainer), **_value_state(trainer)}

    fresh = make_resume_trainer(critic=critic, precision=precision)
    # what the snapshot must restore differs in a fresh trainer
    assert fresh.iteration == 0 and fresh.kl_ctl.value != snapshot["trainer"]["kl_controller"]["value"]
    assert not fresh.optimizers[0].state and fresh.optimizers[0].param_groups[0]["lr"] != expected[0]["lr"]
    random.random()  # python's RNG (no PPO step draws from it; user code may) moves on...
    fresh.load_state_dict(snapshot)
    assert random.getstate() == snapshot["rng"]["python"]  # ...and is restored
    got = [comparable(fresh.step()) for _ in range(2)]

    assert fresh.iteration == trainer.iteration == 3
    assert got == expected  # bit for bit: same process, same operations
    got_weights = {**policy_state(fresh), **_value_state(fresh)}
    assert got_weights.keys() == expected_weights.keys()
    for key, tensor in expected_weights.items():
        assert torch.equal(got_weights[key], tensor), key


def _value_state(trainer) -> dict[str, torch.Tensor]:
    return {f"value.{k}": v.detach().clone() for k, v in trainer.value_module.state_dict().items()}


def test_tied_and_shared_tensors_round_trip_through_safetensors(tmp_path: Path) -> None:
    config = tiny_llama_config()
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in SmolLM2
    base = torch.arange(16.0)
    views = {"whole": base, "same": base, "reshaped": base.view(4, 4), "slice": base[2:6], "strided": base[::2]}
    folder = write_checkpoint(tmp_path, "iter-000001", {"policy": model.state_dict(), "views": views})

    with safe_open(str(folder / "policy.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
        aliases = json.loads(handle.metadata()["aliases"])
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert stored == set(model.state_dict()) - {"lm_head.weight"}  # the tied matrix is stored once

    found = read_checkpoint(tmp_path)
    assert found.folder == folder
    state = found.state
    fresh = LlamaForCausalLM(config)
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    fresh.load_state_dict(state["policy"], strict=True)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for key, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], tensor), key
    assert state["views"].keys() == views.keys()
    for key, tensor in views.items():
        assert torch.equal(state["views"][key], tensor), key


class _RunsCode:
    """A pickle that calls os.makedirs(path) when it is unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (str(self.path),))


def test_reading_a_checkpoint_never_unpickles_code(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    state = {"rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "n": 1}
    folder = write_checkpoint(tmp_path / "ckpt", "iter-000001", state)
    assert {p.name for p in folder.iterdir()} == {"rng.pt", "n.json", MANIFEST}
    torch.save({"torch": _RunsCode(marker)}, folder / "rng.pt")  # a tampered checkpoint...
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["rng.pt"] = (folder / "rng.pt").stat().st_size  # ...whose manifest agrees
    (folder / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(CheckpointCorruptError, match=r"rng\.pt does not parse: .*Weights only load failed") as caught:
        read_checkpoint(folder)
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()
    # the payload is real: a full unpickler would have run it
    torch.load(folder / "rng.pt", weights_only=False)
    assert marker.is_dir()


def test_read_checkpoint_is_none_without_a_checkpoint(tmp_path: Path) -> None:
    assert read_checkpoint(tmp_path / "missing") is None
    (tmp_path / "root").mkdir()
    assert read_checkpoint(tmp_path / "root") is None
    with pytest.raises(ValueError, match="entry names"):
        write_checkpoint(tmp_path / "root", "iter-000001", {"../escape": 1})
    with pytest.raises(ValueError, match="not be MANIFEST"):
        write_checkpoint(tmp_path / "root", "iter-000001", {"MANIFEST": 1})
    # a crash during the first write leaves only a temporary folder: still no checkpoint
    (tmp_path / "root" / ".iter-000001.tmp-x").mkdir()
    (tmp_path / "root" / ".iter-000001.tmp-x" / "policy.safetensors").write_bytes(b"half")
    assert read_checkpoint(tmp_path / "root") is None
