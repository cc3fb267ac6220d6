"""The PPO loop for causal language models, one iteration at a time.

    iteration = rollout -> score -> reference log-probs + values -> rewards -> GAE
                -> K epochs x M minibatches (fresh shuffle each epoch, micro-batch accumulation)

The math lives in small modules (losses, advantages, kl, rewards); this file only orders it,
moves tensors, steps optimizers and keeps the state a resumed run needs.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ppo_core.config import DeviceConfig, SamplingConfig
from ppo_core.lm.distributed import DataParallel
from ppo_core.lm.logprobs import (
    log_softmax_and_entropy,
    response_logits,
    response_logprobs,
    selective_log_softmax,
)
from ppo_core.lm.masked import masked_mean, masked_sum
from ppo_core.lm.models import disable_dropout, pick_device, stop_token_ids
from ppo_core.lm.packing import response_states
from ppo_core.lm.precision import MasterWeights, prefer_eager_attention, resolve_precision
from ppo_core.lm.rollout import Rollout, generate, left_pad
from ppo_core.lm.sharding import gradient_sync
from ppo_core.ppo import checkpointing
from ppo_core.ppo.config import PPOConfig
from ppo_core.ppo.experience import (
    Experience,
    PromptSampler,
    ScoreFn,
    compute_advantages,
    in_chunks,
)
from ppo_core.ppo.kl import kl_penalty_per_token, make_kl_controller
from ppo_core.ppo.losses import clipped_surrogate_loss, clipped_value_loss, explained_variance
from ppo_core.ppo.metrics import (
    MICRO_STEP_KEYS,
    MetricAccumulator,
    MetricsCallback,
    rollout_metrics,
    sample_table,
    timing_metrics,
)
from ppo_core.ppo.value import CriticModel, SharedValueHead


class PolicyOutput(NamedTuple):
    logprobs: torch.Tensor  # [batch, response_len] fp32, log pi_theta(a_t | s_t)
    entropy: torch.Tensor | None  # [batch, response_len] fp32, H(pi_theta(. | s_t)); None unless asked
    hidden: torch.Tensor | None  # [batch, response_len + 1, hidden]: shared value head only


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class PPOTrainer:
    """PPO on a causal LM against any `ScoreFn`.

    `ref_model=None` with a peft policy uses the base model (adapter disabled) as reference,
    so the reference costs no second copy of the weights.
    """

    def __init__(
        self, config: PPOConfig, sampling: SamplingConfig, policy: nn.Module, ref_model: nn.Module | None,
        critic: CriticModel | None, tokenizer: PreTrainedTokenizerBase, score_fn: ScoreFn,
        prompts: Sequence[Sequence[int]], device: DeviceConfig | None = None,
        on_metrics: MetricsCallback | None = None, parallel: DataParallel | None = None,
    ) -> None:
        self.config, self.sampling, self.tokenizer = config, sampling, tokenizer
        self.dp = parallel or DataParallel()
        self.dp.check_batch(config.batch_size, config.mini_batch_size)
        self.device_config = device or DeviceConfig()
        self.device = pick_device(self.device_config.device)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.policy = policy.to(self.device)
        self.ref_model = ref_model.to(self.device).eval() if ref_model is not None else None
        if self.ref_model is None and not hasattr(policy, "disable_adapter"):
            raise ValueError("ref_model is required unless the policy is a peft model (adapter disabled = reference)")
        self.shared_head = SharedValueHead(int(policy.config.hidden_size)).to(self.device) if config.critic == "shared" else None
        if config.critic == "separate" and critic is None:
            raise ValueError("PPOConfig.critic='separate' needs a CriticModel")
        self.critic = critic.to(self.device) if config.critic == "separate" and critic is not None else None
        for model in (self.policy, self.ref_model, self.critic):
            if model is not None:
                disable_dropout(model)
        if self.device_config.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
            if self.critic is not None:
                self.critic.gradient_checkpointing_enable()
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False)
        self.score_fn, self.on_metrics = score_fn, on_metrics
        self.prompts = [list(p) for p in prompts]
        self.sampler = PromptSampler(len(self.prompts), config.batch_size, config.seed)
        self.stop_ids = stop_token_ids(tokenizer, sampling.stop_token_ids)
        self.pad_id = int(tokenizer.pad_token_id)
        self.kl_ctl = make_kl_controller(config.kl.init_coef, config.kl.target, config.kl.horizon)
        self._set_precision_and_sync()
        self.optimizers = self._make_optimizers()
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, self._lr_lambda) for opt in self.optimizers]
        self.shuffle_gen = torch.Generator().manual_seed(config.seed + 1)
        self.iteration = 0
        self.consecutive_skips = 0
        self._seed_rank()
        self.last_experience: Experience | None = None

    # ---- set-up -----------------------------------------------------------------------
    @property
    def value_module(self) -> nn.Module:
        """The module that holds the value weights: the separate critic, else the shared head."""
        return self.critic if self.critic is not None else self.shared_head

    def _set_precision_and_sync(self) -> None:
        """bf16 (ppo_core.lm.precision): the reference holds bf16 weights, the policy and the
        value module compute with bf16 weights refreshed from fp32 masters once per step (cast
        before DDP wraps them); with fp32 the masters are the parameters themselves. FSDP2 keeps
        fp32 shards and applies its own mixed-precision policy (bf16 compute on CUDA). Then DDP
        (broadcasts rank 0's weights) or FSDP2 (shards them, before the optimizers see them)."""
        self.compute_dtype, self.precision_reason = resolve_precision(self.device_config.precision, self.device)
        if self.ref_model is not None:
            self.ref_model.to(self.compute_dtype)
        trained = (self.policy, self.value_module)
        if not self.dp.sharded:
            self.weights = [MasterWeights.cast(m, self.compute_dtype) for m in trained]
            for m in trained:
                prefer_eager_attention(m, self.device, self.compute_dtype)
        fsdp_bf16 = self.device.type == "cuda" and self.compute_dtype == torch.bfloat16
        self.grad_sync = gradient_sync(self.dp, trained, self.device, fsdp_bf16)
        if self.dp.sharded:  # the sharded parameters, fp32: a pass-through
            self.weights = [MasterWeights(m.parameters()) for m in trained]

    def _make_optimizers(self) -> list[torch.optim.Optimizer]:
        cfg = self.config
        policy_params, value_params = (w.master_params() for w in self.weights)
        critic_lr = cfg.critic_learning_rate or cfg.learning_rate
        # fused: one kernel per step on CPU and CUDA, the same update as the default for-loop
        # AdamW (timings in tests/bench/README.md)
        kwargs = {"eps": cfg.adam_eps, "weight_decay": cfg.weight_decay, "fused": True}
        return [
            torch.optim.AdamW(policy_params, lr=cfg.learning_rate, **kwargs),
            torch.optim.AdamW(value_params, lr=critic_lr, **kwargs),
        ]

    def _seed_rank(self) -> None:
        """Each data-parallel rank samples with its own seed (one process keeps config.seed)."""
        if self.dp.enabled:
            torch.manual_seed(self.config.seed + 1_000_003 * self.dp.rank + self.iteration)

    def _lr_lambda(self, iteration: int) -> float:
        if self.config.lr_schedule == "constant":
            return 1.0
        return max(0.0, 1.0 - iteration / self.config.total_iterations)


    def _reference(self) -> tuple[nn.Module, Callable[[], contextlib.AbstractContextManager]]:
        """The reference model and a factory of the context to run it in: peft's
        disable_adapter() is a one-shot generator context, so each forward needs a fresh one."""
        if self.ref_model is not None:
            return self.ref_model, contextlib.nullcontext
        return self.policy, self.policy.disable_adapter

    # ---- one iteration ----------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run one PPO iteration and return (and emit) its metrics."""
        t0 = time.perf_counter()
        rollout = self._rollout()
        t1 = time.perf_counter()
        raw_scores = self.score_fn(rollout).to(self.device).float()
        t2 = time.perf_counter()
        exp = self._experience(rollout, raw_scores)
        t3 = time.perf_counter()
        update = self._update(exp)
        t4 = time.perf_counter()
        seq_kl = self.dp.sum(masked_sum(exp.kl, exp.mask)).item() / self.config.batch_size
        beta = self.kl_ctl.value
        lr = self.optimizers[0].param_groups[0]["lr"]  # the LR this iteration's update used
        self.kl_ctl.update(seq_kl, self.config.batch_size)
        for scheduler in self.schedulers:
            scheduler.step()
        self.iteration += 1
        self.last_experience = exp
        metrics = {
            **rollout_metrics(exp, beta, raw_scores, kl_in_reward=self.config.kl.in_reward),
            **update,
            "lr": lr,
            **timing_metrics(exp, (t0, t1, t2, t3, t4), self.config.ppo_epochs),
        }
        metrics = self.dp.mean_floats(metrics)  # the update's are already global; rollouts' per rank
        if self.on_metrics is not None:
            self.on_metrics(self.iteration, metrics)
        return metrics

    @torch.no_grad()
    def _rollout(self) -> Rollout:
        indices = self.dp.local_slice(self.sampler.batch(self.iteration))
        query_ids, query_mask = left_pad([self.prompts[i] for i in indices], self.pad_id)
        with self.grad_sync.gathered():  # fsdp: whole weights while generating
            rollout = generate(
                self.policy, query_ids, query_mask, self.sampling, self.stop_ids, self.pad_id,
                want_logprobs=self.config.logprobs_from_generation,
            )
        rollout.prompt_index = torch.tensor(indices, device=rollout.query_ids.device)
        return rollout.trimmed()

    @torch.no_grad()
    def _experience(self, rollout: Rollout, raw_scores: torch.Tensor) -> Experience:
        cfg, temp = self.config, self.sampling.temperature
        old, ref, values = [], [], []
        ref_model, ref_ctx = self._reference()
        packed = cfg.pack_sequences
        with self.grad_sync.gathered():  # fsdp: whole weights for the whole scoring pass
            for rows in in_chunks(rollout.query_ids.shape[0], cfg.effective_micro_batch_size):
                part = rollout.select(rows)
                ids, am, n = part.input_ids, part.attention_mask, part.response_len
                hidden = None
                if part.logprobs is None:
                    policy_out = self._policy_forward(ids, am, n)
                    old.append(policy_out.logprobs)
                    hidden = policy_out.hidden
                else:
                    old.append(part.logprobs)
                    if self.shared_head is not None:  # the trunk's states only: no LM head, no log-softmax
                        hidden = response_states(self.policy, ids, am, n + 1, False, packed)[1]
                with ref_ctx():
                    ref.append(response_logprobs(ref_model, ids, am, n, temp, cfg.logprob_chunk_size, packed)[0])
                values.append(self._values(ids, am, n, hidden))
        mask = rollout.response_mask.float()
        return compute_advantages(
            cfg, rollout, raw_scores, torch.cat(old) * mask, torch.cat(ref) * mask,
            torch.cat(values).float() * mask, self.kl_ctl.value, reduce=self.dp.sum,
        )

    def _policy_forward(self, ids: torch.Tensor, am: torch.Tensor, n: int, entropy: bool = False) -> PolicyOutput:
        """Policy log-probs of the response (and its entropy, from the same log-softmax); with a
        shared value head also the final hidden states, so values cost no second trunk forward."""
        cfg, temperature = self.config, self.sampling.temperature
        hidden = None
        if self.shared_head is None:
            logits = response_logits(self.policy, ids, am, n, temperature, cfg.pack_sequences)
        else:
            logits, hidden = response_states(self.policy, ids, am, n + 1, True, cfg.pack_sequences)
            logits = logits[:, :-1, :] / temperature
        if not entropy:
            return PolicyOutput(selective_log_softmax(logits, ids[:, -n:], cfg.logprob_chunk_size), None, hidden)
        logprobs, entropies = log_softmax_and_entropy(logits, ids[:, -n:], cfg.logprob_chunk_size, cfg.ent_coef > 0)
        return PolicyOutput(logprobs, entropies, hidden)

    def _values(self, ids: torch.Tensor, am: torch.Tensor, n: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """Values of the response tokens: the separate critic's forward, or the shared head on the
        policy's final hidden states (`hidden`, from the forward that also gave the log-probs)."""
        if self.critic is not None:
            return self.critic(ids, am, n, self.config.pack_sequences)
        return self.shared_head(hidden, n)

    # ---- the update epochs ------------------------------------------------------------
    def _update(self, exp: Experience) -> dict[str, float]:
        cfg = self.config
        acc = MetricAccumulator()
        epochs_done = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(cfg.batch_size, generator=self.shuffle_gen)
            stop = False
            for mb_positions in order.split(cfg.mini_batch_size):
                stats = self._minibatch_step(exp, self.dp.local_rows(mb_positions).to(exp.mask.device))
                acc.add(stats)
                if cfg.target_kl_early_stop is not None and stats["policy/approxkl"] > cfg.target_kl_early_stop:
                    stop = True
                    break
            epochs_done += 1
            if stop:
                break
        out = acc.means()
        out["policy/epochs_completed"] = float(epochs_done)
        out["optim/skipped_steps"] = acc.total("optim/skipped")
        return out

    def _minibatch_step(self, exp: Experience, rows: torch.Tensor) -> dict[str, float]:
        # the minibatch's token count over all ranks normalises the loss (see ppo_core.lm.distributed)
        n_tokens = float(self.dp.sum(exp.mask[rows].sum()).clamp(min=1))
        acc = MetricAccumulator()
        # DDP all-reduces (SUM) in the last micro-batch's backward; a rank without rows gets weight 0
        for chunk, weight in self.grad_sync.micro_batches(rows, self.config.effective_micro_batch_size):
            micro = self._micro_step(exp.select(chunk), n_tokens, weight)
            acc.add(micro if weight else {})
        stats = self.dp.sum_floats(dict.fromkeys(MICRO_STEP_KEYS, 0.0) | acc.sums())
        norms, finite = self._step_models(math.isfinite(stats["loss/total"]))
        self.consecutive_skips = 0 if finite else self.consecutive_skips + 1
        if self.consecutive_skips >= self.config.max_consecutive_nonfinite:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive PPO steps had a non-finite loss or gradient "
                f"(iteration {self.iteration}); stopping with the last good checkpoint intact"
            )
        stats.update({"optim/grad_norm_policy": norms[0], "optim/grad_norm_critic": norms[1]})
        stats["optim/skipped"] = 0.0 if finite else 1.0
        return stats

    def _step_models(self, loss_finite: bool) -> tuple[tuple[float, float], bool]:
        """(gradient norms before clipping, whether the models stepped). The policy, then the
        value module: each one's gradients move to its fp32 masters (bf16), are clipped, stepped
        and released before the next one's move, so only one model's fp32 gradients exist at a
        time. The later models' gradients are checked first: a non-finite loss or gradient
        anywhere skips every step."""
        finite = loss_finite and all(weights.grads_finite() for weights in self.weights[1:])
        norms = []
        for opt, weights in zip(self.optimizers, self.weights, strict=True):
            weights.accumulate_grads()
            norms.append(self._clip_gradients(opt))
            finite = finite and math.isfinite(norms[-1])
            if finite:
                opt.step()
                weights.publish()
            opt.zero_grad(set_to_none=True)
        return (norms[0], norms[1]), finite

    def _clip_gradients(self, opt: torch.optim.Optimizer) -> float:
        """Total gradient norm before clipping; clip_grad_norm_ without its pass multiplying by 1."""
        params, limit = opt.param_groups[0]["params"], self.config.max_grad_norm or float("inf")
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if float(limit / (norm + 1e-6)) < 1.0:  # clip_grad_norm_'s coefficient, before its clamp
            torch.nn.utils.clip_grads_with_norm_(params, limit, norm)
        return float(norm)

    def _train_forward(self, ids: torch.Tensor, am: torch.Tensor, n: int) -> tuple[PolicyOutput, torch.Tensor]:
        policy_out = self._policy_forward(ids, am, n, entropy=True)
        return policy_out, self._values(ids, am, n, policy_out.hidden)

    def _micro_step(self, mb: Experience, n_tokens: float, weight: float = 1.0) -> dict[str, float]:
        """Forward (inside DDP's, see GradientSync) + backward of weight * loss on one micro-batch;
        losses are sums / minibatch token count, so accumulated gradients equal one forward over
        the whole minibatch."""
        cfg, mask = self.config, mb.mask
        ids, am, n = mb.rollout.input_ids, mb.rollout.attention_mask, mb.rollout.response_len
        policy_out, values = self.grad_sync(self._train_forward, ids, am, n)
        logprobs, entropy = policy_out.logprobs, policy_out.entropy
        pg_loss, pg = clipped_surrogate_loss(logprobs, mb.old_logprobs, mb.advantages, mask, cfg.cliprange, n_tokens)
        vf_loss, vf = clipped_value_loss(values, mb.values, mb.returns, mask, cfg.cliprange_value, n_tokens)
        loss = pg_loss + cfg.vf_coef * vf_loss - cfg.ent_coef * masked_sum(entropy, mask) / n_tokens
        if not cfg.kl.in_reward:
            kl = kl_penalty_per_token(logprobs, mb.old_logprobs, mb.ref_logprobs, cfg.kl.estimator)
            loss = loss + self.kl_ctl.value * masked_sum(kl, mask) / n_tokens
        (loss * weight).backward()  # x 1.0 is exact
        share = float(mask.sum()) / n_tokens
        return {
            "loss/policy": pg_loss.item(), "loss/value": vf_loss.item(), "loss/total": loss.item(),
            "policy/approxkl": pg["approxkl"].item() * share,
            "policy/clipfrac": pg["clipfrac"].item() * share,
            "policy/ratio_mean": pg["ratio_mean"].item() * share,
            "policy/entropy": masked_mean(entropy.detach(), mask).item() * share,
            "val/clipfrac": vf["clipfrac"].item() * share,
            "val/explained_variance": explained_variance(values.detach(), mb.returns, mask).item() * share,
        }

    def sample_table(self, n: int = 8) -> list[dict[str, str | float]]:
        """A few responses of the last iteration, decoded, with their score and KL, for people."""
        return sample_table(self.last_experience, self.tokenizer, n)

    # ---- the run and its checkpoints -------------------------------------------------
    def train(self, iterations: int, checkpoint_dir: str | Path | None = None, every: int = 1) -> list[dict]:
        """Run until self.iteration == iterations, checkpointing every `every` iterations."""
        history = []
        while self.iteration < iterations:
            history.append(self.step())
            if checkpoint_dir is not None and (self.iteration % every == 0 or self.iteration == iterations):
                self.save(checkpoint_dir)
        return history

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit, one entry per checkpoint file
        (ppo_core.ppo.checkpointing). As with nn.Module.state_dict the tensors are the live ones:
        deepcopy for a snapshot. A sharded trainer's are its shards: checkpoint it with `save`."""
        return checkpointing.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` (of a trainer in one process or DDP: whole tensors); with data
        parallelism every rank then reseeds its sampling (the state holds rank 0's RNG)."""
        checkpointing.load_state_dict(self, state)

    def save(self, root: str | Path) -> Path:
        """Atomically checkpoint as root/iter-NNNNNN (ppo_core.ppo.checkpointing; sharded: per rank)."""
        return checkpointing.save(self, root)

    def load(self, root_or_folder: str | Path) -> Path | None:
        """Restore from a checkpoint folder or a root (its `latest`, else its newest intact
        checkpoint), plain or sharded; returns the folder loaded, None when there is none."""
        return checkpointing.load(self, root_or_folder)
