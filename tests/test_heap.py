"""Heap retention in the pipeline's processes (flows.runtime, flows.workers): glibc's mmap
threshold fixed by `bound_heap_retention`, and the free heap handed back by `release_free_heap`
after every PPO iteration. Probed with plain malloc in fresh processes: no models needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


HEAP_PROBE = """
import ctypes, os, sys
sys.path.insert(0, sys.argv[3])
from flows.runtime import bound_heap_retention, release_free_heap

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
MiB = 2**20
page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block

mode, size = sys.argv[1], int(sys.argv[2])
if mode != "default":
    bound_heap_retention()
libc.free(touched(16 * MiB))  # a freed mapped block: a dynamic threshold rises to 16 MiB
before = rss()
blocks = [touched(size) for _ in range(384 * MiB // size)]
for block in blocks[:-1]:  # the last one stays: the heap's top cannot shrink
    libc.free(block)
if mode == "released":
    release_free_heap()
print((rss() - before) / MiB)
"""


@pytest.mark.parametrize(("mode", "block_kib", "retained"), [
    ("default", 8192, True),  # glibc's dynamic threshold put the 8 MiB blocks on the heap
    ("bounded", 8192, False),  # fixed at 1 MiB: each has its own mapping, unmapped when freed
    ("bounded", 512, True),  # under the threshold: on the heap, as it should be (no page faults)
    ("released", 512, False),  # what the PPO loop does after every iteration
])
def test_freed_blocks_leave_rss_once_the_heap_retention_is_bounded_or_released(mode: str, block_kib: int, retained: bool) -> None:
    """flows.runtime: after a 16 MiB block was freed, 384 MiB of blocks are made and all but the
    last freed, in a fresh process. glibc's default keeps freed 8 MiB blocks (a tensor's size)
    resident; `bound_heap_retention` (the pipeline and every PPO worker call it) unmaps them;
    blocks under its 1 MiB threshold stay on the heap until `release_free_heap` (after every PPO
    iteration, flows.workers) hands the heap's free pages back."""
    if not Path("/proc/self/statm").exists() or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        pytest.skip("needs Linux's /proc and glibc's default malloc settings")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", HEAP_PROBE, mode, str(block_kib * 1024), str(REPO)], env=env,
                          capture_output=True, text=True, check=False)
    if "libc.so.6" in done.stderr:
        pytest.skip("no glibc")
    assert done.returncode == 0, done.stderr
    retained_mib = float(done.stdout)
    if retained:
        assert retained_mib > 300, retained_mib
    else:
        assert retained_mib < 40, retained_mib


def test_the_ppo_loop_hands_the_free_heap_back_after_every_iteration(trainer_factory, tmp_path: Path, monkeypatch) -> None:
    """flows.workers._run_iterations (a round's loop in every process) releases the heap after
    each PPO iteration, before the checkpoint it may save: 3 iterations, 3 releases."""
    from flows import workers
    from flows.config import PPOStageConfig

    trainer = trainer_factory()
    seen: list[int] = []
    monkeypatch.setattr(workers, "release_free_heap", lambda: seen.append(trainer.iteration))
    saves: list[int] = []
    monkeypatch.setattr(trainer, "save", lambda root: saves.append(len(seen)))
    job = workers.RoundJob.model_construct(
        ppo=PPOStageConfig(iterations_per_round=3, checkpoint_every=2), round_number=1, folder=str(tmp_path))
    workers._run_iterations(trainer, job)
    assert seen == [1, 2, 3]
    assert saves == [2, 3]  # after iterations 2 and 3, each after that iteration's release
