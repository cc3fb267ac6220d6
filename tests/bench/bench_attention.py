"""Attention-core benchmark: transformers' eager attention against ppo_core.lm.attention in bf16.

    python tests/bench/bench_attention.py --rows 2 --length 418 --heads 9 --kv-heads 3 --repeats 10

One layer's attention at the shapes of the default update micro-step (SmolLM2-135M: 9 heads, 3
key/value heads, head dim 64; 16 rows packed as 2 x 418 tokens under a block-causal mask):
scores, softmax, times values, forward and backward, the two implementations alternately on the
same inputs. Per implementation: the min and median milliseconds of the forward and of forward +
backward over the repeats after a warm-up, and the bytes autograd saves. Not a test: pytest never
collects it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make `ppo_core` and `tests.` importable from the checkout
from ppo_core.lm.attention import attention_forward  # noqa: E402
from tests.test_attention import saved_tensor_bytes  # noqa: E402


class _Layer(torch.nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads


def _inputs(args) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    def leaf(heads: int) -> torch.Tensor:
        return torch.randn(args.rows, heads, args.length, args.head_dim, generator=g).bfloat16().requires_grad_()
    causal = torch.ones(args.length, args.length, dtype=torch.bool).tril()
    mask = torch.zeros(args.rows, 1, args.length, args.length, dtype=torch.bfloat16)
    mask = mask.masked_fill(~causal, torch.finfo(torch.bfloat16).min)
    return leaf(args.heads), leaf(args.kv_heads), leaf(args.kv_heads), mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=418)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layer = _Layer(args.heads, args.kv_heads).train()
    q, k, v, mask = _inputs(args)
    grad = torch.randn(args.rows, args.length, args.heads, args.head_dim).bfloat16()
    impls = {"transformers eager": eager_attention_forward, "ppo_core": attention_forward}

    def forward(fn) -> torch.Tensor:
        return fn(layer, q, k, v, mask, scaling=args.head_dim**-0.5)[0]

    times: dict[str, dict[str, list[float]]] = {name: {"forward": [], "forward+backward": []} for name in impls}
    for repeat in range(args.repeats + 1):
        for name, fn in impls.items():
            start = time.perf_counter()
            out = forward(fn)
            mid = time.perf_counter()
            out.backward(grad)
            end = time.perf_counter()
            q.grad = k.grad = v.grad = None
            if repeat:  # the first round warms up
                times[name]["forward"].append(1e3 * (mid - start))
                times[name]["forward+backward"].append(1e3 * (end - start))
    print(f"rows {args.rows} x {args.heads} heads x {args.length}^2, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for name, fn in impls.items():
        saved = saved_tensor_bytes(lambda fn=fn: forward(fn)) / 2**20
        cells = ", ".join(f"{part} min {min(ts):.1f} / median {statistics.median(ts):.1f} ms" for part, ts in times[name].items())
        print(f"{name:20s} saved {saved:6.1f} MiB; {cells}")


if __name__ == "__main__":
    main()
