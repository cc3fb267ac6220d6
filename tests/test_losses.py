"""The PPO objective (ppo_core.ppo.losses): where the clip stops the gradient, and token averaging.

L^CLIP = E[min(rho A, clip(rho, 1-eps, 1+eps) A)] (Schulman et al. 2017, eq. 7). We minimise
-L^CLIP, so d(-L)/d log pi = -A rho / N where the unclipped term is the active one, and exactly 0
where the ratio has already moved past the band in the direction the advantage pushes it.
"""

from __future__ import annotations

import pytest
import torch

from ppo_core.ppo.losses import (
    clipped_surrogate_loss,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
)

EPS = 0.2
RATIOS = [0.5, 0.75, 0.85, 1.0, 1.1, 1.25, 1.6]  # none exactly on a band edge


def _policy_grid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every ratio crossed with positive and negative advantages (old log-prob arbitrary)."""
    rho = torch.tensor(RATIOS, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 2.0], dtype=torch.float64)
    rho, adv = torch.meshgrid(rho, adv, indexing="ij")
    old = torch.linspace(-3.0, -0.5, rho.numel(), dtype=torch.float64).view_as(rho)
    return rho, adv, old


def test_policy_gradient_is_zero_exactly_where_the_clip_is_active() -> None:
    rho, adv, old = _policy_grid()
    logprobs = (old + rho.log()).requires_grad_(True)
    mask = torch.ones_like(rho)
    loss, stats = clipped_surrogate_loss(logprobs, old, adv, mask, EPS)
    loss.backward()
    n = rho.numel()
    clipped_zone = ((adv > 0) & (rho > 1 + EPS)) | ((adv < 0) & (rho < 1 - EPS))
    expected = torch.where(clipped_zone, torch.zeros_like(rho), -adv * rho / n)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-12, rtol=0)
    # the grid holds both kinds of token, so the check above is not vacuous
    assert clipped_zone.any() and (~clipped_zone).any()
    assert stats["clipfrac"].item() == pytest.approx(clipped_zone.double().mean().item())
    # outside the band on the "wrong" side the gradient is the unclipped one (pessimism)
    wrong_side = ((adv > 0) & (rho < 1 - EPS)) | ((adv < 0) & (rho > 1 + EPS))
    assert wrong_side.any()
    assert torch.all(logprobs.grad[wrong_side] != 0)


def test_policy_loss_value_and_masked_tokens_get_no_gradient() -> None:
    rho, adv, old = _policy_grid()
    logprobs = (old + rho.log()).requires_grad_(True)
    mask = torch.ones_like(rho)
    mask[::2, 1] = 0
    loss, _ = clipped_surrogate_loss(logprobs, old, adv, mask, EPS)
    loss.backward()
    per_token = torch.maximum(-adv * rho, -adv * rho.clamp(1 - EPS, 1 + EPS))
    assert loss.item() == pytest.approx((per_token * mask).sum().item() / mask.sum().item())
    assert torch.all(logprobs.grad[mask == 0] == 0)


def test_value_gradient_is_zero_exactly_where_the_value_clip_is_active() -> None:
    eps_v = 0.2
    old = torch.zeros(6, dtype=torch.float64)
    values = torch.tensor([0.5, 0.5, 0.1, -0.5, -0.5, 0.05], dtype=torch.float64)
    returns = torch.tensor([0.0, 1.0, 1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    # case by case: clip(V) = old +- 0.2; the clipped term wins when (clip(V)-R)^2 > (V-R)^2
    clip_active = torch.tensor([False, True, False, True, False, False])
    leaf = values.clone().requires_grad_(True)
    loss, stats = clipped_value_loss(leaf, old, returns, torch.ones(6), eps_v)
    loss.backward()
    expected = torch.where(clip_active, torch.zeros_like(values), (values - returns) / 6)
    torch.testing.assert_close(leaf.grad, expected, atol=1e-12, rtol=0)
    assert stats["clipfrac"].item() == pytest.approx(2 / 6)
    v_clip = old + (values - old).clamp(-eps_v, eps_v)
    worst = torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    assert loss.item() == pytest.approx(0.5 * worst.mean().item())


def test_value_loss_without_clipping_is_plain_half_mse() -> None:
    values = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    loss, _ = clipped_value_loss(
        values, torch.zeros(3, dtype=torch.float64), returns, torch.ones(3), None
    )
    loss.backward()
    torch.testing.assert_close(values.grad, (values.detach() - returns) / 3, atol=1e-12, rtol=0)


def test_micro_batch_sums_with_minibatch_normaliser_equal_the_full_token_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    b, t = 6, 5
    lengths = torch.tensor([5, 1, 3, 2, 5, 4])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=gen) * 3
    logprobs = old + 0.4 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, t, generator=gen)
    values, old_v, returns = (torch.randn(b, t, generator=gen) for _ in range(3))
    full_pg, _ = clipped_surrogate_loss(logprobs, old, adv, mask, EPS)
    full_vf, _ = clipped_value_loss(values, old_v, returns, mask, 0.2)
    n_tokens = float(mask.sum())
    pg_sum = vf_sum = 0.0
    naive_pg = []
    for rows in torch.arange(b).split(2):
        part = (logprobs[rows], old[rows], adv[rows], mask[rows])
        pg_sum += clipped_surrogate_loss(*part, EPS, normaliser=n_tokens)[0].item()
        vf_sum += clipped_value_loss(
            values[rows], old_v[rows], returns[rows], mask[rows], 0.2, n_tokens
        )[0].item()
        naive_pg.append(clipped_surrogate_loss(*part, EPS)[0].item())
    assert pg_sum == pytest.approx(full_pg.item(), abs=1e-6)
    assert vf_sum == pytest.approx(full_vf.item(), abs=1e-6)
    # averaging per-micro-batch means is NOT the token mean on ragged rows: the normaliser matters
    assert abs(sum(naive_pg) / len(naive_pg) - full_pg.item()) > 1e-3


def test_entropy_from_logits_matches_definition() -> None:
    logits = torch.randn(4, 7, 11, dtype=torch.float64) * 3
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(logp.exp() * logp).sum(-1))
    torch.testing.assert_close(entropy_from_logits(logits, torch.logsumexp(logits, -1)), entropy_from_logits(logits))


def test_explained_variance_perfect_constant_and_worse() -> None:
    returns = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.ones(3, 5)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    const = torch.full_like(returns, float(returns.mean()))
    assert explained_variance(const, returns, mask).item() == pytest.approx(0.0, abs=1e-9)
    assert explained_variance(-returns, returns, mask).item() < 0
