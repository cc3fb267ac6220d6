"""Measuring one PPO iteration for tests/bench/bench_ppo.py: per-phase time and peak memory
(`Meter`), the plain-transformers baselines the ratios divide by (`PlainBaselines`), and the
`--profile` split of each phase into forwards, backward, optimizer, clip and log-softmax time."""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from transformers import GenerationConfig

from ppo_core import PPOTrainer, Rollout
from ppo_core.lm.logprobs import position_ids_from_mask
from ppo_core.lm.peak_memory import reset_rss_peak, rss_peak_bytes
from ppo_core.lm.rollout import left_pad


# ---- measuring ------------------------------------------------------------------------
class Meter:
    """Wall time (device-synchronised) and peak memory of named phases."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[dict[str, dict[str, float]]] = []
        self.peak_resettable = device.type == "cuda" or reset_rss_peak()
        self.current: str | None = None
        self.open_parts: set[str] = set()

    def new_iteration(self) -> None:
        self.rows.append(
            defaultdict(lambda: {"s": 0.0, "cpu_s": 0.0, "peak_mib": 0.0, "delta_mib": 0.0})
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        """A top-level phase: time and peak memory; nested `part`s break its time down."""
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            start_mem = torch.cuda.memory_allocated(self.device)
        else:
            reset_rss_peak()
            start_mem = rss_peak_bytes()
        outer, self.current = self.current, name
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.sync()
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            self.current = outer
            peak = (
                torch.cuda.max_memory_allocated(self.device)
                if self.device.type == "cuda"
                else rss_peak_bytes()
            )
            row = self.rows[-1][name]
            row["s"] += elapsed
            row["cpu_s"] += cpu
            row["peak_mib"] = max(row["peak_mib"], peak / 2**20)
            row["delta_mib"] = max(row["delta_mib"], (peak - start_mem) / 2**20)

    @contextlib.contextmanager
    def part(self, name: str):
        """Time only, booked as "<enclosing phase>/<name>" (with --profile); a part inside one
        of the same name (a wrapped forward calling another) is booked once."""
        if self.current is None or name in self.open_parts:
            yield
            return
        self.sync()
        self.open_parts.add(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.open_parts.discard(name)
            self.rows[-1][f"{self.current}/{name}"]["s"] += time.perf_counter() - t0

    def wrap_by_model(self, names: dict[int, str], fn: Callable) -> Callable:
        """`fn(model, ...)` timed as the part `names[id(model)]` (untimed for other models)."""

        @functools.wraps(fn)
        def timed(model, *args, **kwargs):
            name = names.get(id(model))
            if name is None:
                return fn(model, *args, **kwargs)
            with self.part(name):
                return fn(model, *args, **kwargs)

        return timed

    def wrap(self, name: str, fn: Callable, part: bool = False) -> Callable:
        """`fn` timed as a phase (or a part); functools.wraps keeps its signature visible,
        which transformers inspects on `forward`."""
        measure = self.part if part else self.phase

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with measure(name):
                return fn(*args, **kwargs)

        return timed


class PlainBaselines:
    """The two reference measurements: plain sampling, and plain training steps on copies."""

    def __init__(self, trainer: PPOTrainer, meter: Meter) -> None:
        self.trainer, self.meter = trainer, meter
        cfg, device = trainer.config, trainer.device
        self.policy = copy.deepcopy(trainer.policy)
        self.critic = copy.deepcopy(trainer.critic) if trainer.critic is not None else None
        impl = {k: trainer.optimizers[0].defaults.get(k) for k in ("fused", "foreach")}
        kwargs = {
            "lr": cfg.learning_rate,
            "eps": cfg.adam_eps,
            "weight_decay": cfg.weight_decay,
            **impl,
        }
        self.optimizers = [torch.optim.AdamW(self.policy.parameters(), **kwargs)]
        if self.critic is not None:
            self.optimizers.append(torch.optim.AdamW(self.critic.parameters(), **kwargs))
        sampling = trainer.sampling
        # the trainer's sampling settings and nothing from the model's own generation defaults
        self.gen_config = GenerationConfig(
            do_sample=True, max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.min_new_tokens,
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            eos_token_id=list(trainer.stop_ids), pad_token_id=trainer.pad_id, use_cache=True,
            return_dict_in_generate=True,
        )
        self.cuda_devices = [device] if device.type == "cuda" else []

    def generate(self) -> torch.Tensor:
        """transformers' model.generate on the batch the next trainer.step will sample (the RNG
        state is restored after it, so the trainer's draws do not depend on it). The two samplers
        draw different tokens, so runs may differ in length: compare time per generated token."""
        t = self.trainer
        indices = t.sampler.batch(t.iteration)
        ids, mask = left_pad([t.prompts[i] for i in indices], t.pad_id)
        ids, mask = ids.to(t.device), mask.to(t.device)
        rng = torch.random.fork_rng(devices=self.cuda_devices)
        with rng, torch.no_grad(), self.meter.phase("plain_generate"):
            out = t.policy.generate(
                input_ids=ids, attention_mask=mask, generation_config=self.gen_config
            )
        return out.sequences[:, ids.shape[1] :]

    def train_step(self, rollout: Rollout) -> None:
        """One causal-LM step of the policy and one value-regression step of the critic over
        the rollout's (trimmed) token rectangle."""
        ids, am, n = rollout.input_ids, rollout.attention_mask, rollout.response_len
        labels = ids.masked_fill(am == 0, -100)
        with self.meter.phase("plain_train_step"):
            loss = self.policy(
                input_ids=ids,
                attention_mask=am,
                position_ids=position_ids_from_mask(am),
                labels=labels,
                use_cache=False,
            ).loss
            if self.critic is not None:
                loss = loss + self.critic(ids, am, n).float().pow(2).mean()
            loss.backward()
            for opt in self.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)


def install_profile(
    meter: Meter, trainer: PPOTrainer, scorer: torch.nn.Module, plain: PlainBaselines | None
) -> None:
    """--profile: book forwards, backward, optimizer, master-weight copies, log-softmax and entropy
    time inside each phase, so the update splits into forward / backward / optimizer (and the plain
    step too)."""
    import ppo_core.lm.logprobs
    import ppo_core.ppo.trainer

    # The packed scoring and training forwards call the trunk and the LM head, not `forward`.
    packed = {id(trainer.policy): "policy_forward", id(trainer.ref_model): "ref_forward"}
    if plain is not None:
        packed[id(plain.policy)] = "policy_forward"
    for module in (ppo_core.lm.logprobs, ppo_core.ppo.trainer):
        module.response_states = meter.wrap_by_model(packed, module.response_states)
    forwards = [
        (trainer.policy, "policy_forward"),
        (trainer.ref_model, "ref_forward"),
        (trainer.critic, "critic_forward"),
        (scorer.model.backbone, "reward_forward"),
    ]
    if plain is not None:  # --no-ratios: no plain baselines to profile
        forwards += [(plain.policy, "policy_forward"), (plain.critic, "critic_forward")]
    for module, name in forwards:
        if module is not None:
            module.forward = meter.wrap(name, module.forward, part=True)
    for opt in [*trainer.optimizers, *(plain.optimizers if plain is not None else [])]:
        opt.step = meter.wrap("optimizer", opt.step, part=True)
    trainer._clip_gradients = meter.wrap("clip_grad", trainer._clip_gradients, part=True)
    torch.Tensor.backward = meter.wrap("backward", torch.Tensor.backward, part=True)
    for weights in trainer.weights:  # bf16: gradients into the fp32 masters, masters back to bf16
        weights.accumulate_grads = meter.wrap("master_grads", weights.accumulate_grads, part=True)
        weights.publish = meter.wrap("master_publish", weights.publish, part=True)
    for module in (ppo_core.lm.logprobs, ppo_core.ppo.trainer):
        module.selective_log_softmax = meter.wrap(
            "log_softmax", module.selective_log_softmax, part=True
        )
    ppo_core.ppo.trainer.log_softmax_and_entropy = meter.wrap(
        "log_softmax+entropy", ppo_core.ppo.trainer.log_softmax_and_entropy, part=True
    )


# ---- the run --------------------------------------------------------------------------
