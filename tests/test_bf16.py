"""PPO in bf16 (ppo_core.lm.precision): the policy and critic compute with bf16 weights and fp32
masters, the reference holds bf16 weights. The classic bf16 PPO bug is sampling and training
numerics that disagree, so that the ratio is not 1 before the first update: checked here, with
stated tolerances, next to the fp32 path's exact checks in test_trainer.py."""

from __future__ import annotations

import pytest
import torch

from ppo_core.config import SamplingConfig
from ppo_core.lm.logprobs import response_logprobs
from tests.conftest import build_trainer
from tests.test_trainer import _assert_learns, _learning_curve
from tests.tiny import tiny_llama

# bf16 keeps 8 bits of mantissa: log-probs of a 2-layer model move by a few 1e-3 nats
LOGPROB_TOL = 0.03
RATIO_TOL = 1e-3


def test_bf16_log_probs_stay_within_tolerance_of_fp32() -> None:
    torch.manual_seed(0)
    fp32 = tiny_llama(seed=3)
    bf16 = tiny_llama(seed=3).to(torch.bfloat16)
    ids = torch.randint(4, 40, (4, 12))
    mask = torch.ones_like(ids)
    exact, _ = response_logprobs(fp32, ids, mask, 6)
    rough, _ = response_logprobs(bf16, ids, mask, 6)
    assert rough.dtype == torch.float32  # the log-softmax runs in fp32 on bf16 logits
    gap = (rough - exact).abs().max().item()
    assert 0 < gap < LOGPROB_TOL, gap


@pytest.mark.parametrize(
    "overrides",
    [{}, {"logprobs_from_generation": False}, {"critic": "shared", "micro_batch_size": 2}],
    ids=["generation-logprobs", "forward-logprobs", "shared-micro"],
)
def test_bf16_first_update_sees_ratio_one_and_near_zero_kl(overrides: dict) -> None:
    trainer = build_trainer(batch_size=8, num_mini_batches=1, ppo_epochs=1, precision="bf16", **overrides)
    assert trainer.compute_dtype == torch.bfloat16
    assert {p.dtype for p in trainer.policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.optimizers[0].param_groups[0]["params"]} == {torch.float32}
    metrics = trainer.step()
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=RATIO_TOL)
    assert metrics["policy/clipfrac"] == 0.0
    # generation's cached-KV log-probs and the reference's full forward round differently in bf16
    assert metrics["objective/kl"] == pytest.approx(0.0, abs=RATIO_TOL)


def test_bf16_ppo_learns() -> None:
    history = _learning_curve(20, precision="bf16")
    _assert_learns(history, margin=2.0)


def test_bf16_weights_follow_the_masters_after_each_step() -> None:
    trainer = build_trainer(batch_size=8, num_mini_batches=2, ppo_epochs=1, precision="bf16",
                            sampling=SamplingConfig(max_new_tokens=6))
    trainer.step()
    for weights in trainer.weights:
        for param, master in zip(weights.params, weights.master_params(), strict=True):
            assert param.grad is None and torch.equal(param, master.detach().to(torch.bfloat16))
