"""Data-parallel PPO (ppo_core.lm.distributed): W gloo processes train exactly as one process does
on the same samples (separate critic, and value head on a shared LoRA trunk), torch's DDP with a SUM
hook reduces the gradients once per minibatch, only rank 0 writes, and the pipeline runs a round
under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppo_core.lm.distributed import DataParallel
from ppo_core.ppo.metrics import MICRO_STEP_KEYS
from tests import dist_worker
from tests.pipeline_fixtures import PPO_STAGES, UPSTREAM, Run, load_cfg, metric_steps, run_pipeline

pytest_plugins = ["tests.pipeline_fixtures"]

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 3
EXACT_KEYS = dist_worker.EXACT_KEYS


def torchrun(processes: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module", params=["separate", "shared"])
def critic(request: pytest.FixtureRequest) -> str:
    """The separate critic model (packed forwards), or the value head on the trunk of a LoRA
    policy (one module used by two losses; frozen base weights DDP must leave alone; gradient
    checkpointing, plain forwards)."""
    return request.param


@pytest.fixture(scope="module")
def two_process_run(critic: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"dp2-{critic}")
    done = torchrun(2, "-m", "tests.dist_worker", str(out), str(ITERATIONS), critic)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_process_run(critic: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"dp1-{critic}")
    torch.manual_seed(0)
    dist_worker.run(out, ITERATIONS, critic=critic)
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_two_processes_train_exactly_like_one(
    critic: str, two_process_run: Path, one_process_run: Path
) -> None:
    dp, single = torch.load(two_process_run / "rank0.pt"), torch.load(one_process_run / "rank0.pt")
    for it, (m2, m1) in enumerate(zip(dp["history"], single["history"], strict=True)):
        for key in EXACT_KEYS:
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), f"iteration {it + 1}: {key}"
    assert dp["kl_coef"] == pytest.approx(single["kl_coef"], rel=1e-6)
    assert single["kl_coef"] != dist_worker.CONFIG.kl.init_coef  # the adaptive controller moved
    start = dist_worker.build(critic=critic)  # training moved the weights: equality means something
    assert _max_diff(single["policy"], start.policy.state_dict()) > 1e-3
    assert _max_diff(single["value"], start.value_module.state_dict()) > 1e-3
    assert _max_diff(dp["policy"], single["policy"]) < 1e-5
    assert _max_diff(dp["value"], single["value"]) < 1e-5


def test_ddp_sum_reduces_the_gradients_once_per_minibatch(
    two_process_run: Path, one_process_run: Path
) -> None:
    """torch's DDP (not a hand-written all-reduce) reduces, with the SUM hook (not DDP's mean),
    in the last micro-batch's backward only (no_sync before), and the reduced gradient of the
    first minibatch is the one-process gradient although the ranks hold unequal token counts:
    a mean over ranks would halve it, a second all-reduce after DDP's would double it."""
    r0, r1 = torch.load(two_process_run / "rank0.pt"), torch.load(two_process_run / "rank1.pt")
    single = torch.load(one_process_run / "rank0.pt")
    minibatches = ITERATIONS * dist_worker.CONFIG.ppo_epochs * dist_worker.CONFIG.num_mini_batches
    for rank in (r0, r1):
        assert rank["ddp"] == {"wrapped": True, "comm_hook": "_sum_hook", "reductions": minibatches}
        assert rank["micro_steps"] > minibatches  # the other micro-steps ran under no_sync()
    assert single["ddp"] == {"wrapped": False, "comm_hook": None, "reductions": 0}
    assert r0["local_tokens"][0] != r1["local_tokens"][0]
    assert r0["local_tokens"][0] + r1["local_tokens"][0] == single["local_tokens"][0]
    grads, expected = r0["first_grads"], single["first_grads"]
    assert grads.keys() == expected.keys()
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 1e-3
    assert _max_diff(grads, expected) < 1e-5 * scale
    assert _max_diff(grads, r1["first_grads"]) == 0.0


def test_a_rank_without_rows_of_a_minibatch_joins_with_a_zero_gradient(
    two_process_run: Path, one_process_run: Path
) -> None:
    """Rank 1 holds none of the minibatch's rows: it runs a weight-0 micro-step (DDP needs every
    rank in the all-reduce) and the step equals one process's on the same rows."""
    r0, r1 = (torch.load(two_process_run / f"rank{r}.pt")["one_sided"] for r in (0, 1))
    single = torch.load(one_process_run / "rank0.pt")["one_sided"]
    assert r1["local_tokens"] == (0,) and r0["local_tokens"] == single["local_tokens"]
    assert single["stats"]["optim/grad_norm_policy"] > 1e-3 and not single["stats"]["optim/skipped"]
    assert r0["stats"].keys() == single["stats"].keys()
    for key, value in single["stats"].items():
        assert r0["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert r0["stats"] == r1["stats"]
    for part in ("policy", "value"):
        assert _max_diff(r0[part], single[part]) < 1e-5
        assert _max_diff(r0[part], r1[part]) == 0.0


def test_ranks_hold_identical_weights_and_only_rank_0_checkpoints(two_process_run: Path) -> None:
    r0, r1 = torch.load(two_process_run / "rank0.pt"), torch.load(two_process_run / "rank1.pt")
    assert _max_diff(r0["policy"], r1["policy"]) == 0.0
    assert _max_diff(r0["value"], r1["value"]) == 0.0
    assert r0["history"] == r1["history"]  # reduced metrics are the same on every rank
    folders = sorted(p.name for p in (two_process_run / "checkpoints").iterdir())
    assert folders == [f"iter-{ITERATIONS:06d}", "latest"]


def test_minibatch_rows_partition_the_global_minibatch() -> None:
    order = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    for world in (1, 2, 3, 4):
        batch = list(range(100, 112))
        slices = [DataParallel(r, world).local_slice(batch) for r in range(world)]
        assert sorted(x for s in slices for x in s) == batch
        for minibatch in order.split(6):
            members = []
            for rank in range(world):
                rows = DataParallel(rank, world).local_rows(minibatch)
                members += [slices[rank][i] for i in rows.tolist()]
            assert sorted(members) == sorted(batch[i] for i in minibatch.tolist())


def test_micro_step_reports_exactly_the_reduced_keys() -> None:
    trainer = dist_worker.build()
    exp = trainer._experience(trainer._rollout(), torch.ones(8))
    stats = trainer._micro_step(exp.select(torch.arange(2)), float(exp.mask.sum()))
    trainer.optimizers[0].zero_grad()
    assert set(stats) == set(MICRO_STEP_KEYS)


def test_batch_must_split_over_processes() -> None:
    with pytest.raises(ValueError, match="divisible by the number of data-parallel processes"):
        DataParallel(0, 3).check_batch(8, 4)
    with pytest.raises(ValueError, match="smaller than the number"):
        DataParallel(0, 4).check_batch(8, 2)
    from flows.config import ConfigError

    with pytest.raises(ConfigError, match=r"ppo.*divisible"):
        load_cfg(["ppo.processes=3"])


@pytest.fixture(scope="module")
def parallel_run(pipeline_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The tiny pipeline with its PPO rounds in 2 torchrun processes, in its own folder (the
    main folder's scenarios count its stage folders)."""
    return run_pipeline(tmp_path_factory.mktemp("parallel"), ["ppo.processes=2"])


def test_pipeline_round_runs_in_two_processes(parallel_run: Run) -> None:
    assert parallel_run.result is not None, f"parallel run failed: {parallel_run.error!r}"
    assert all(parallel_run.stages[s] == "Completed" for s in (*UPSTREAM, *PPO_STAGES))
    per_round = load_cfg().ppo.iterations_per_round
    # rank 0 alone logs: every iteration exactly once
    assert metric_steps(parallel_run, "ppo_round_1") == list(range(1, per_round + 1))
    assert metric_steps(parallel_run, "ppo_round_2") == list(range(per_round + 1, 2 * per_round + 1))
    folder = Path(parallel_run.result["policy_path"])
    assert (folder / "model.safetensors").exists() and (folder.parent / "samples.json").exists()
    assert (folder.parent / "job.json").exists()  # the round went through the torchrun launcher
