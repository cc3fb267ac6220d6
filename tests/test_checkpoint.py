"""Checkpoints (ppo_core.lm.checkpoint, PPOTrainer.save/load): a resumed run is the same run, and
a checkpoint is either complete and pointed to by `latest`, or absent."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ppo_core.ppo.state
from ppo_core.lm.checkpoint import (
    LATEST,
    CheckpointWriteError,
    atomic_checkpoint,
    latest_checkpoint,
    prune_checkpoints,
)
from tests.resume_worker import TOTAL_ITERATIONS, make_resume_trainer, policy_state

REPO = Path(__file__).resolve().parents[1]
VOLATILE = ("time/", "throughput/")


def _comparable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


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
        expected, got = _comparable(expected), _comparable(got)
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

    trainer.step()
    monkeypatch.setattr(ppo_core.ppo.state, "save_state", broken)
    with pytest.raises(OSError, match="no space"):
        trainer.save(tmp_path)
    monkeypatch.undo()

    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000001"}
    fresh = make_resume_trainer()
    assert fresh.load(tmp_path) and fresh.iteration == 1
    for key, tensor in policy_state(fresh).items():
        torch.testing.assert_close(tensor, saved[key], atol=0, rtol=0)


def test_keep_last_prunes_old_checkpoints_and_empty_root_loads_nothing(tmp_path: Path) -> None:
    for i in range(1, 5):
        with atomic_checkpoint(tmp_path, f"iter-{i:06d}", keep_last=2) as folder:
            (folder / "x").write_text(str(i))
    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000003", "iter-000004"}
    assert latest_checkpoint(tmp_path) == tmp_path / "iter-000004"
    assert make_resume_trainer().load(tmp_path / "nothing-here") is False
    prune_checkpoints(tmp_path, keep_last=1)
    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000004"}
    # `latest` survives even when it is not the newest name
    with atomic_checkpoint(tmp_path, "iter-000009", keep_last=None) as folder:
        (folder / "x").write_text("9")
    (tmp_path / LATEST).write_text("iter-000004")
    prune_checkpoints(tmp_path, keep_last=1)
    assert {p.name for p in tmp_path.iterdir()} == {LATEST, "iter-000004", "iter-000009"}
    prune_checkpoints(tmp_path / "empty", keep_last=1)  # no checkpoints: nothing to do
