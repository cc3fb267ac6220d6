"""Checkpoints survive crashes (ppo_core.lm.checkpoint): a manifest of file sizes, every file and
folder fsynced before it is published, reads that name the damaged file, and a resume that falls
back to the newest intact checkpoint."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path

import pytest
import torch

from ppo_core.lm.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointCorruptError,
    prune_checkpoints,
    read_checkpoint,
    verify_checkpoint,
    write_checkpoint,
)
from tests.resume_worker import TOTAL_ITERATIONS, comparable, make_resume_trainer, policy_state


def _small_state(i: int) -> dict:
    return {"policy": {"w": torch.full((64,), float(i))}, "trainer": {"iteration": i}, "rng": {"t": (i, i)}}


def _write(root: Path, i: int, keep_last: int | None = None) -> Path:
    return write_checkpoint(root, f"iter-{i:06d}", _small_state(i), keep_last=keep_last)


def test_manifest_lists_every_file_and_a_fresh_checkpoint_verifies(tmp_path: Path) -> None:
    folder = _write(tmp_path, 1)
    manifest = json.loads((folder / MANIFEST).read_text())
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != MANIFEST}
    assert set(files) == {"policy.safetensors", "trainer.json", "rng.pt"}
    assert manifest == {"format": 1, "files": files}
    assert verify_checkpoint(folder) == files
    found = read_checkpoint(tmp_path)
    assert found.folder == folder and found.state["trainer"] == {"iteration": 1}
    assert torch.equal(found.state["policy"]["w"], torch.full((64,), 1.0))
    assert read_checkpoint(folder).folder == folder  # the folder itself reads the same
    # a root whose pointer was never written (a crash right after the first rename) still reads
    (tmp_path / LATEST).unlink()
    assert read_checkpoint(tmp_path).folder == folder


def test_every_file_and_folder_is_fsynced_before_it_is_published(tmp_path: Path, monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path.resolve()
    folder = _write(root, 1)
    monkeypatch.undo()

    published = events.index(("replace", str(folder)))
    pointed = events.index(("replace", str(root / LATEST)))
    synced = [(i, Path(path)) for i, (kind, path) in enumerate(events) if kind == "fsync"]
    tmp = next(path for _, path in synced if path.name.startswith(".iter-000001.tmp-"))
    before = {path for i, path in synced if i < published}
    # every file (the manifest too) and the temporary folder, before the rename publishes them
    assert {tmp / p.name for p in folder.iterdir()} | {tmp} <= before
    assert {p.name for p in folder.iterdir()} == {"policy.safetensors", "trainer.json", "rng.pt", MANIFEST}
    # the root after the folder's rename, the pointer before its own, the root again after it
    assert any(path == root for i, path in synced if published < i < pointed)
    assert any(path.name.startswith(".latest.") for i, path in synced if published < i < pointed)
    assert any(path == root for i, path in synced if i > pointed)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_corrupt_latest_falls_back_to_the_previous_checkpoint_and_resumes_the_same_run(
    tmp_path: Path, caplog
) -> None:
    straight = make_resume_trainer()
    straight_history = straight.train(TOTAL_ITERATIONS, checkpoint_dir=tmp_path)  # keeps the last 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000003", "iter-000004", LATEST]
    _truncate(tmp_path / "iter-000004" / "policy.safetensors")  # a torn write of the newest

    resumed = make_resume_trainer()
    with caplog.at_level(logging.WARNING, logger="ppo_core.lm.checkpoint"):
        assert resumed.load(tmp_path) == tmp_path / "iter-000003"
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "iter-000004: policy.safetensors has size" in warning
    assert resumed.iteration == 3
    # pruning keeps `latest` and the newest intact checkpoint, the one just loaded
    prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000003", "iter-000004", LATEST]

    history = resumed.train(TOTAL_ITERATIONS, checkpoint_dir=tmp_path)
    [expected], [got] = (comparable(m) for m in straight_history[3:]), (comparable(m) for m in history)
    assert expected.keys() == got.keys()
    assert {k: (v, got[k]) for k, v in expected.items() if not math.isclose(v, got[k], rel_tol=1e-5, abs_tol=1e-6)} == {}
    for key, tensor in policy_state(straight).items():
        torch.testing.assert_close(policy_state(resumed)[key], tensor, atol=1e-6, rtol=0, msg=key)
    # the rewritten iter-000004 is intact again and `latest`
    assert read_checkpoint(tmp_path).folder == tmp_path / "iter-000004"


def _delete(path: Path) -> None:
    path.unlink()


CORRUPTIONS = {
    "deleted file": ("policy.safetensors", _delete, r"policy\.safetensors is missing \(\d+ bytes expected\)"),
    "zero-length json": ("trainer.json", lambda p: p.write_bytes(b""), r"trainer\.json has size 0 bytes, expected \d+"),
    "missing manifest": (MANIFEST, _delete, r"MANIFEST\.json is missing"),
    "garbled manifest": (MANIFEST, lambda p: p.write_text("{"), r"MANIFEST\.json does not parse: JSONDecodeError"),
    "same-size garbage": (
        "policy.safetensors", lambda p: p.write_bytes(b"\xff" * p.stat().st_size), r"policy\.safetensors does not parse: "
    ),
    "unlisted state file": ("extra.pt", lambda p: torch.save({"x": 1}, p), r"extra\.pt is not in MANIFEST\.json"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_a_corrupt_checkpoint_is_reported_naming_its_folder_and_file(tmp_path: Path, case: str) -> None:
    name, corrupt, expected = CORRUPTIONS[case]
    folder = _write(tmp_path, 1)
    corrupt(folder / name)
    with pytest.raises(CheckpointCorruptError, match=f"checkpoint {re.escape(str(folder))}: {expected}"):
        read_checkpoint(folder)
    with pytest.raises(CheckpointCorruptError, match=f"no intact checkpoint in {re.escape(str(tmp_path))}; .*{expected}"):
        read_checkpoint(tmp_path)


def test_when_every_checkpoint_is_corrupt_the_error_lists_them_all(tmp_path: Path, caplog) -> None:
    for i in (1, 2, 3):
        _write(tmp_path, i)
    (tmp_path / LATEST).write_text("iter-000002")  # tried first, then the others newest first
    _truncate(tmp_path / "iter-000001" / "rng.pt")
    (tmp_path / "iter-000002" / "trainer.json").write_bytes(b"")
    (tmp_path / "iter-000003" / MANIFEST).unlink()

    with (
        caplog.at_level(logging.WARNING, logger="ppo_core.lm.checkpoint"),
        pytest.raises(CheckpointCorruptError) as caught,
    ):
        read_checkpoint(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"no intact checkpoint in {tmp_path}; tried, in order: ")
    tried = [
        "iter-000002: trainer.json has size 0", "iter-000003: MANIFEST.json is missing", "iter-000001: rng.pt has size"
    ]
    positions = [message.index(t) for t in tried]
    assert positions == sorted(positions)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all(t in w for t, w in zip(tried, warnings, strict=True))
    # pruning keeps `latest` even though it is corrupt, and deletes the other corrupt ones
    prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000002", LATEST]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_a_replaced_folder_is_never_missing_and_the_old_one_is_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    from ppo_core.lm import folders

    final = tmp_path / "model"
    final.mkdir()
    (final / "old.bin").write_text("old")
    seen = []
    real_exchange, real_replace = folders._exchange, os.replace

    def watch_exchange(a: Path, b: Path) -> bool:
        done = real_exchange(a, b) if exchange else False
        seen.append(final.is_dir())
        return done

    def watch_replace(src, dst) -> None:
        real_replace(src, dst)
        seen.append(final.is_dir())

    monkeypatch.setattr(folders, "_exchange", watch_exchange)
    monkeypatch.setattr(folders.os, "replace", watch_replace)
    new = folders.temp_folder_for(final)
    assert new.parent == tmp_path and new.name.startswith(".model.tmp-")
    (new / "new.bin").write_text("new")
    folders.replace_folder(new, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the old contents and the temp name are gone
    assert [p.name for p in final.iterdir()] == ["new.bin"]
    # with the exchange, `model` exists after every step; with two renames there is one
    # moment without it (the old folder is under .model.old-PID then: remove_debris's case)
    assert seen == ([True] if exchange else [True, False, True])


def test_debris_of_killed_writers_is_removed_and_nothing_else(tmp_path: Path) -> None:
    from ppo_core.lm.folders import remove_debris

    keep = [tmp_path / "a" / "model" / "w.bin", tmp_path / "a" / "state" / "latest", tmp_path / ".run.lock"]
    debris = [tmp_path / "a" / ".model.tmp-123" / "w.bin", tmp_path / "a" / "state" / ".iteration-2.old-9" / "x",
              tmp_path / "a" / "state" / ".latest.tmp-abc"]
    for path in [*keep, *debris]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    removed = remove_debris(tmp_path)
    assert sorted(p.name for p in removed) == [".iteration-2.old-9", ".latest.tmp-abc", ".model.tmp-123"]
    assert all(p.exists() for p in keep) and not any(p.parent.exists() and p.exists() for p in debris)
