"""The C heap in the pipeline's processes (flows.runtime, flows.workers): `configure_heap`
keeps freed memory for reuse (no page faults for the next step's tensors), `release_free_heap`
hands it back after every PPO iteration, and `configure_environment` bounds oneDNN's primitive
cache, whose scattered entries would keep freed blocks from reuse. Probed in fresh processes
(plain malloc, small matmuls): no models needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


HEAP_PROBE = """
import ctypes, os, resource, sys
sys.path.insert(0, sys.argv[3])
from flows.runtime import configure_heap, release_free_heap

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
MiB = 2**20
page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def step(size):  # a training step's tensors: made, written, freed
    blocks = [libc.malloc(size) for _ in range(256 * MiB // size)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)

mode, size = sys.argv[1], int(sys.argv[2])
if mode != "default":
    configure_heap()
before = rss()
step(size)
if mode == "released":
    release_free_heap()
retained = (rss() - before) / MiB
start = faults()
step(size)  # the next step
print(retained, (faults() - start) * page / (256 * MiB))
"""


@pytest.mark.parametrize(("mode", "block_kib", "retained", "refaulted"), [
    ("default", 65536, False, True),  # glibc maps blocks this large afresh: zero-filled pages again
    ("configured", 65536, True, False),  # kept on the heap, reused by the next step
    ("configured", 512, True, False),
    ("released", 65536, False, True),  # what the PPO loop does after every iteration
    ("released", 512, False, True),
])
def test_the_heap_keeps_freed_tensors_for_the_next_step_until_released(
    mode: str, block_kib: int, retained: bool, refaulted: bool
) -> None:
    """flows.runtime in a fresh process: a "step" makes, writes and frees 256 MiB of blocks, then
    a second step does the same. With glibc's defaults 64 MiB blocks (a logits tensor's size) get
    mappings of their own, unmapped when freed, so the next step page-faults all its memory again.
    After `configure_heap` (the pipeline and every PPO worker call it) freed blocks stay resident
    and the next step reuses them without a fault; `release_free_heap` (after every PPO
    iteration, flows.workers) hands them back."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("needs Linux's /proc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", HEAP_PROBE, mode, str(block_kib * 1024), str(REPO)], env=env,
                          capture_output=True, text=True, check=False)
    if "libc.so.6" in done.stderr:
        pytest.skip("no glibc")
    assert done.returncode == 0, done.stderr
    retained_mib, refaulted_share = map(float, done.stdout.split())
    assert (retained_mib > 200) if retained else (retained_mib < 40), retained_mib
    assert (refaulted_share > 0.8) if refaulted else (refaulted_share < 0.1), refaulted_share


def test_the_heap_is_left_alone_where_the_environment_sets_glibc_malloc() -> None:
    """A user's glibc malloc setting (here MALLOC_TRIM_THRESHOLD_) wins: `configure_heap` changes
    nothing, and 64 MiB blocks are mapped afresh at every step as glibc's default does."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("needs Linux's /proc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"MALLOC_TRIM_THRESHOLD_": "1048576"}
    done = subprocess.run([sys.executable, "-c", HEAP_PROBE, "configured", str(64 * 2**20), str(REPO)], env=env,
                          capture_output=True, text=True, check=False)
    if "libc.so.6" in done.stderr:
        pytest.skip("no glibc")
    assert done.returncode == 0, done.stderr
    retained_mib, refaulted_share = map(float, done.stdout.split())
    assert retained_mib < 40 and refaulted_share > 0.8, (retained_mib, refaulted_share)


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


PRIMITIVE_PROBE = """
import os, sys
sys.path.insert(0, sys.argv[1])
from flows.runtime import configure_environment
configure_environment(sys.argv[2])
import torch
w = torch.randn(64, 64, dtype=torch.bfloat16)
for rows in [*range(2, 132), 2]:  # 130 shapes, then the first again (1 row is no matmul)
    torch.nn.functional.linear(torch.randn(rows, 64, dtype=torch.bfloat16), w)
"""


@pytest.mark.parametrize(("user_capacity", "first_shape_again"), [(None, "cache_miss"), ("1024", "cache_hit")])
def test_onednn_keeps_a_bounded_primitive_cache_unless_the_user_sets_one(
    tmp_path: Path, user_capacity: str | None, first_shape_again: str
) -> None:
    """flows.runtime.configure_environment bounds oneDNN's primitive cache at 128 entries: after
    130 bf16 matmul shapes the first one is compiled again (oneDNN's verbose log says cache_miss);
    with the user's own ONEDNN_PRIMITIVE_CACHE_CAPACITY (here oneDNN's default, 1024) it is still
    cached. Fresh processes: oneDNN reads the capacity once."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    env["ONEDNN_VERBOSE"] = "profile_create"
    if user_capacity:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = user_capacity
    done = subprocess.run([sys.executable, "-c", PRIMITIVE_PROBE, str(REPO), str(tmp_path)], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    creates = [line for line in done.stdout.splitlines() if ",primitive,create:" in line and ",matmul," in line]
    if not creates:
        pytest.skip("torch runs bf16 matmuls without oneDNN on this CPU")
    assert len(creates) == 131, len(creates)
    assert all("create:cache_miss" in line for line in creates[:130])
    assert f"create:{first_shape_again}" in creates[-1], creates[-1]
