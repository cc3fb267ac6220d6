"""PPOTrainer end to end on tiny models: it learns, accumulates exactly, guards against NaN,
emits its documented metrics, and trains LoRA adapters against the adapter-disabled base."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from ppo_core.config import DeviceConfig, SamplingConfig
from ppo_core.lm.logprobs import response_logprobs
from ppo_core.lm.models import disable_dropout
from ppo_core.lm.tiny import tiny_llama_config
from ppo_core.ppo.config import KLConfig, PPOConfig
from ppo_core.ppo.trainer import NonFiniteError, PPOTrainer
from ppo_core.ppo.value import CriticModel
from tests.conftest import TARGET_TOKEN, build_trainer, count_token_score, make_prompts, tiny_gpt2
from tests.tiny import tiny_llama, tiny_tokenizer

LEARN = {"batch_size": 16, "num_mini_batches": 2, "ppo_epochs": 4, "learning_rate": 3e-3}


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _max_change(before: dict[str, torch.Tensor], module: torch.nn.Module) -> float:
    return max((p.detach() - before[k]).abs().max().item() for k, p in module.named_parameters())


def _learning_curve(iterations: int, **overrides) -> list[dict[str, float]]:
    trainer = build_trainer(sampling=SamplingConfig(max_new_tokens=8), **{**LEARN, **overrides})
    return [trainer.step() for _ in range(iterations)]


def _assert_learns(history: list[dict[str, float]], margin: float) -> None:
    scores = [m["objective/scores"] for m in history]
    start, end = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert end > start + margin, f"mean reward {start:.2f} -> {end:.2f}: {scores}"
    for metrics in history:
        assert math.isfinite(metrics["objective/kl"]) and math.isfinite(metrics["loss/total"])


def test_ppo_raises_a_programmatic_reward() -> None:
    # reward = count of TARGET_TOKEN among 8 new tokens; a random policy scores ~8/44
    history = _learning_curve(30)
    _assert_learns(history, margin=3.0)
    assert history[-1]["objective/kl"] > 0  # moving away from the reference costs KL


@pytest.mark.parametrize(
    "overrides",
    [{"critic": "shared"}, {"kl": KLConfig(in_reward=False)}],
    ids=["shared-critic", "kl-as-loss"],
)
def test_ppo_variants_learn_with_finite_metrics(overrides: dict) -> None:
    history = _learning_curve(20, **overrides)
    _assert_learns(history, margin=2.0)
    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert bad == {}


def test_kl_as_a_loss_term_holds_the_policy_near_the_reference() -> None:
    """beta = 1 as a loss term must restrain the KL that beta = 0 lets grow (an unweighted k1
    loss term had a reference-independent gradient and let it grow just as much)."""
    free = _learning_curve(14, kl=KLConfig(in_reward=False, init_coef=0.0))
    leashed = _learning_curve(14, kl=KLConfig(in_reward=False, init_coef=1.0))
    kl_free = sum(m["objective/kl"] for m in free[-3:]) / 3
    kl_leashed = sum(m["objective/kl"] for m in leashed[-3:]) / 3
    assert kl_free > 4.0, kl_free
    assert kl_leashed < 0.3 * kl_free, (kl_leashed, kl_free)


def _experience(trainer: PPOTrainer):
    rollout = trainer._rollout()
    return trainer._experience(rollout, trainer.score_fn(rollout).float())


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"logprobs_from_generation": False},
        {"critic": "shared", "micro_batch_size": 2},
    ],
    ids=["generation-logprobs", "forward-logprobs", "shared-micro"],
)
def test_first_update_sees_ratio_one_and_zero_kl_to_identical_reference(overrides: dict) -> None:
    """Before any optimizer step pi_theta == pi_old, so every ratio is 1 (old log-probs, from
    generation or a forward, agree with the training forward of trimmed micro-batches), and a
    policy initialised as its reference has zero KL."""
    trainer = build_trainer(batch_size=8, num_mini_batches=1, ppo_epochs=1, **overrides)
    metrics = trainer.step()
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["policy/approxkl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["policy/clipfrac"] == 0.0
    assert metrics["objective/kl"] == pytest.approx(0.0, abs=1e-5)


def test_micro_batch_accumulation_equals_one_big_minibatch() -> None:
    # many stop ids -> ragged responses, so each micro-batch trims to a different width
    sampling = SamplingConfig(max_new_tokens=8, stop_token_ids=list(range(4, 12)))
    whole = build_trainer(sampling=sampling, batch_size=8, num_mini_batches=1)
    micro = build_trainer(sampling=sampling, batch_size=8, num_mini_batches=1, micro_batch_size=2)
    exp = _experience(whole)
    lengths = exp.mask.sum(1)
    assert lengths.unique().numel() > 2
    before = _params(whole.policy)
    rows = torch.arange(8)
    stats_whole = whole._minibatch_step(exp, rows)
    stats_micro = micro._minibatch_step(exp, rows)
    assert _max_change(before, whole.policy) > 1e-4
    for name, module in (("policy", "policy"), ("critic", "critic")):
        a, b = (
            dict(getattr(whole, module).named_parameters()),
            dict(getattr(micro, module).named_parameters()),
        )
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=f"{name}.{key}")
    for key in ("loss/policy", "loss/value", "policy/approxkl", "policy/clipfrac"):
        assert stats_micro[key] == pytest.approx(stats_whole[key], abs=1e-5), key


def nan_score(rollout) -> torch.Tensor:
    scores = count_token_score()(rollout)
    scores[0] = float("nan")
    return scores


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_nan_scores_skip_every_step_and_leave_weights_untouched() -> None:
    trainer = build_trainer(score_fn=nan_score, max_consecutive_nonfinite=10)
    policy_before, critic_before = _params(trainer.policy), _params(trainer.critic)
    metrics = trainer.step()
    # 2 epochs x 2 minibatches, all skipped
    assert metrics["optim/skipped_steps"] == 4.0
    assert _max_change(policy_before, trainer.policy) == 0.0
    assert _max_change(critic_before, trainer.critic) == 0.0
    assert trainer.consecutive_skips == 4


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_nan_streak_raises_non_finite_error_with_weights_intact() -> None:
    trainer = build_trainer(score_fn=nan_score, max_consecutive_nonfinite=3)
    before = _params(trainer.policy)
    with pytest.raises(NonFiniteError, match="3 consecutive"):
        trainer.step()
    assert _max_change(before, trainer.policy) == 0.0


def test_nan_loss_from_a_hook_is_skipped_and_the_streak_resets() -> None:
    """A forward hook poisons the logits of the first two update forwards (grad enabled)
    only; the later steps are finite, so the run continues and learns."""
    trainer = build_trainer(max_consecutive_nonfinite=3)
    poisoned = {"left": 2}

    def poison(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and poisoned["left"] > 0:
            poisoned["left"] -= 1
            return output * float("nan")
        return output

    handle = trainer.policy.lm_head.register_forward_hook(poison)
    before = _params(trainer.policy)
    try:
        metrics = trainer.step()
    finally:
        handle.remove()
    assert metrics["optim/skipped_steps"] == 2.0
    assert trainer.consecutive_skips == 0
    assert _max_change(before, trainer.policy) > 0
    assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_non_finite_critic_gradient_alone_skips_the_policy_step_too(precision: str) -> None:
    """The loss and the policy's gradients are finite; only the critic's gradient is NaN. The
    models step one after the other (the policy first), so the critic must be checked before the
    policy steps: neither may move."""
    trainer = build_trainer(max_consecutive_nonfinite=10, precision=precision)
    critic_weight = next(p for p in trainer.value_module.parameters() if p.requires_grad)
    handle = critic_weight.register_hook(lambda grad: grad * float("nan"))
    policy_before, critic_before = _params(trainer.policy), _params(trainer.critic)
    try:
        metrics = trainer.step()
    finally:
        handle.remove()
    assert math.isfinite(metrics["loss/total"]) and math.isfinite(metrics["optim/grad_norm_policy"])
    assert metrics["optim/skipped_steps"] == 4.0  # 2 epochs x 2 minibatches
    assert _max_change(policy_before, trainer.policy) == 0.0
    assert _max_change(critic_before, trainer.critic) == 0.0


def _llama_with_dropout(p: float) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=44)
    config.attention_dropout = p
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    "factory", [_llama_with_dropout, lambda p: tiny_gpt2(dropout=p)], ids=["llama", "gpt2"]
)
def test_disable_dropout_makes_train_mode_deterministic(factory) -> None:
    model = factory(0.3).train()
    ids = torch.tensor([[5, 9, 14, 22, 30, 41, 8, 15]])
    am = torch.ones_like(ids)

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            return response_logprobs(model, ids, am, 4)[0]

    torch.manual_seed(1)
    first = logprobs()
    assert not torch.equal(first, logprobs())  # dropout is really on before
    disable_dropout(model)
    assert model.training
    torch.testing.assert_close(logprobs(), logprobs(), atol=0, rtol=0)


DOCUMENTED = [
    "objective/kl",
    "objective/entropy",
    "objective/scores",
    "objective/rlhf_reward",
    "policy/approxkl",
    "policy/clipfrac",
    "loss/policy",
    "loss/value",
    "val/explained_variance",
    "val/clipfrac",
    "time/rollout",
    "time/update",
    "throughput/tokens_per_s",
]


def test_step_emits_the_documented_metrics_through_on_metrics() -> None:
    import ppo_core.ppo.metrics

    for key in DOCUMENTED:
        assert key in ppo_core.ppo.metrics.__doc__, key
    seen: list[tuple[int, dict[str, float]]] = []
    trainer = build_trainer()
    trainer.on_metrics = lambda step, metrics: seen.append((step, dict(metrics)))
    returned = trainer.step()
    trainer.step()
    assert [step for step, _ in seen] == [1, 2]
    emitted = seen[0][1]
    assert emitted == returned
    missing = [k for k in DOCUMENTED if k not in emitted]
    assert missing == []
    assert all(math.isfinite(emitted[k]) for k in DOCUMENTED)
    assert emitted["time/rollout"] > 0 and emitted["throughput/tokens_per_s"] > 0
    assert emitted["objective/rlhf_reward"] == pytest.approx(
        emitted["objective/scores"] + emitted["objective/non_score_reward"], abs=1e-6
    )
    assert 0.0 <= emitted["policy/clipfrac"] <= 1.0 and emitted["objective/entropy"] > 0


def test_lora_policy_uses_the_adapter_disabled_base_as_reference() -> None:
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(seed=0)
    critic = CriticModel.from_model(base)
    # init_lora_weights=False: a non-zero adapter, so policy and reference really differ
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    policy = get_peft_model(base, lora)
    config = PPOConfig(
        batch_size=8, num_mini_batches=2, ppo_epochs=1, learning_rate=1e-2, lr_schedule="constant"
    )
    trainer = PPOTrainer(
        config,
        SamplingConfig(max_new_tokens=6),
        policy,
        None,
        critic,
        tiny_tokenizer(),
        count_token_score(TARGET_TOKEN),
        make_prompts(),
        device=DeviceConfig(device="cpu", precision="fp32"),  # exact comparison below
    )
    exp = _experience(trainer)
    reference = tiny_llama(seed=0)  # the same weights as the base before wrapping
    with torch.no_grad():
        expected, _ = response_logprobs(
            reference, exp.rollout.input_ids, exp.rollout.attention_mask, exp.rollout.response_len
        )
    mask = exp.mask.bool()
    torch.testing.assert_close(exp.ref_logprobs[mask], expected[mask], atol=1e-5, rtol=0)
    assert (exp.old_logprobs[mask] - exp.ref_logprobs[mask]).abs().max() > 1e-3

    before = _params(trainer.policy)
    metrics = trainer.step()
    assert math.isfinite(metrics["loss/total"])
    changed = {
        k for k, p in trainer.policy.named_parameters() if not torch.equal(p.detach(), before[k])
    }
    assert changed, "nothing trained"
    assert all("lora_" in k for k in changed), sorted(changed)[:5]


def test_separate_critic_is_required_and_reference_is_required_without_peft() -> None:
    config = PPOConfig(batch_size=4)
    args = (SamplingConfig(max_new_tokens=2), tiny_llama())
    with pytest.raises(ValueError, match="ref_model"):
        PPOTrainer(
            config,
            *args,
            None,
            None,
            tiny_tokenizer(),
            count_token_score(),
            [[5]],
            DeviceConfig(device="cpu"),
        )
    with pytest.raises(ValueError, match="CriticModel"):
        PPOTrainer(
            config,
            *args,
            tiny_llama(),
            None,
            tiny_tokenizer(),
            count_token_score(),
            [[5]],
            DeviceConfig(device="cpu"),
        )


@pytest.mark.parametrize("from_generation", [True, False], ids=["generation-logprobs", "forward-logprobs"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_shared_head_values_of_scoring_equal_the_training_forward(from_generation: bool, packed: bool) -> None:
    """A shared value head reads the policy's final hidden states: the scoring pass (which, with
    log-probs from generation, runs the trunk alone) and the first training forward give the
    same values before any step."""
    trainer = build_trainer(critic="shared", logprobs_from_generation=from_generation, pack_sequences=packed)
    with torch.no_grad():  # the head starts at zero, which would hide any mismatch
        for param in trainer.shared_head.parameters():
            param.normal_()
    rollout = trainer._rollout()
    exp = trainer._experience(rollout, trainer.score_fn(rollout).float())
    r = rollout
    with torch.no_grad():
        _, values = trainer._train_forward(r.input_ids, r.attention_mask, r.response_len)
    mask = r.response_mask.float()
    torch.testing.assert_close(values.float() * mask, exp.values, atol=1e-5, rtol=1e-5)
    assert exp.values.abs().sum() > 0


@pytest.mark.parametrize("limit", [1e-3, 1e3, None])
def test_gradients_are_clipped_to_max_grad_norm_as_torch_clips_them(limit: float | None) -> None:
    """The trainer's clipping returns the total L2 norm before clipping and leaves every gradient
    as torch.nn.utils.clip_grad_norm_ leaves it, bit for bit: scaled to the limit when over it
    (1e-3), untouched when under it (1e3) or with no limit."""
    trainer = build_trainer(max_grad_norm=limit)
    opt = trainer.optimizers[0]
    params = opt.param_groups[0]["params"]
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    before = [p.grad.clone() for p in params]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    for twin, grad in zip(twins, before, strict=True):
        twin.grad = grad.clone()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(twins, limit or float("inf")))
    norm = trainer._clip_gradients(opt)
    flat = torch.cat([g.flatten() for g in before]).double()
    assert norm == torch_norm == pytest.approx(float(flat.norm()), rel=1e-5)
    assert all(torch.equal(p.grad, twin.grad) for p, twin in zip(params, twins, strict=True))
    after = float(torch.cat([p.grad.flatten() for p in params]).double().norm())
    if limit == 1e-3:
        assert after == pytest.approx(1e-3, rel=1e-4)
    else:
        assert all(torch.equal(p.grad, g) for p, g in zip(params, before, strict=True))
