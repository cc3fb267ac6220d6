"""Generation benchmark: the prefill with the shared prompt prefix once against the plain one.

    python tests/bench/bench_generation.py --model smollm2 --batch 32 --new-tokens 32 --repeats 4

The benchmark prompts (prompts.json, SmolLM2's chat template with its default system block) are
repeated up to `--batch` rows and sampled with `ppo_core.lm.decoding.decode`, alternately with
the shared prefix prefilled once at batch 1 (the default) and with every row prefilled whole
(`MIN_SHARED_PREFIX` raised past the prompt length), the same seed for both, runs interleaved.
Per mode: seconds of the prefill and of the whole decode (min and median over the repeats after
a warm-up), and generated tokens per second. Not a test: pytest never collects it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make `tests.` importable
from ppo_core.config import SamplingConfig  # noqa: E402
from ppo_core.lm import decoding  # noqa: E402
from ppo_core.lm.models import stop_token_ids  # noqa: E402
from ppo_core.lm.packing import shared_prefix_len  # noqa: E402
from ppo_core.lm.rollout import left_pad  # noqa: E402
from tests.bench.bench_ppo import load_policy  # noqa: E402

SHARED = decoding.MIN_SHARED_PREFIX
PLAIN = 10**9
"""MIN_SHARED_PREFIX for the plain mode: no prefix is that long."""


def timed_prefill(seconds: list[float]):
    """decoding.prefill, appending its wall time to `seconds`."""
    plain = decoding.prefill

    def prefill(*args):
        start = time.perf_counter()
        out = plain(*args)
        seconds.append(time.perf_counter() - start)
        return out

    return prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="tiny | smollm2 | a path or pkg:NAME")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4, help="timed runs per mode, after one warm-up each")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, prompts = load_policy(args.model)
    model = model.to(torch.bfloat16 if args.precision == "bf16" else torch.float32).eval()
    rows = [prompts[i % len(prompts)] for i in range(args.batch)]
    query_ids, query_mask = left_pad(rows, int(tokenizer.pad_token_id))
    prefix = shared_prefix_len(query_ids, query_mask, keep=1)
    print(f"{args.model}, {args.precision}, {args.batch} rows, prompts {min(map(len, rows))}-{query_ids.shape[1]} "
          f"tokens, shared prefix {prefix}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    stops = stop_token_ids(tokenizer, sampling.stop_token_ids)
    prefill_s: list[float] = []
    decoding.prefill = timed_prefill(prefill_s)
    results: dict[str, dict[str, list[float]]] = {m: {"prefill": [], "total": [], "tokens": []} for m in ("plain", "shared")}
    outputs: dict[str, torch.Tensor] = {}
    for repeat in range(args.repeats + 1):
        for mode, threshold in (("plain", PLAIN), ("shared", SHARED)):
            decoding.MIN_SHARED_PREFIX = threshold
            torch.manual_seed(repeat)
            start = time.perf_counter()
            raw, _ = decoding.decode(model, query_ids, query_mask, sampling, stops, int(tokenizer.pad_token_id))
            total = time.perf_counter() - start
            if repeat == 0:
                continue  # warm-up
            outputs[f"{mode}{repeat}"] = raw
            results[mode]["prefill"].append(prefill_s[-1])
            results[mode]["total"].append(total)
            results[mode]["tokens"].append(float((raw != tokenizer.pad_token_id).sum()))
    for mode, r in results.items():
        tokens_per_s = [t / s for t, s in zip(r["tokens"], r["total"], strict=True)]
        print(f"{mode:>6}: prefill min {min(r['prefill']):.3f} / median {statistics.median(r['prefill']):.3f} s, "
              f"decode min {min(r['total']):.2f} / median {statistics.median(r['total']):.2f} s, "
              f"{statistics.median(tokens_per_s):.0f} tokens/s")
    same = [bool(torch.equal(outputs[f"plain{k}"], outputs[f"shared{k}"])) for k in range(1, args.repeats + 1)]
    print(f"same tokens in both modes: {sum(same)} of {len(same)} runs (the same seed; rounding can flip a draw)")


if __name__ == "__main__":
    main()
