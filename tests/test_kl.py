"""KL estimators and beta controllers (ppo_core.ppo.kl).

With a ~ p, log r = log p(a) - log q(a): E[k1] = E[k3] = KL(p || q) exactly (Schulman 2020), so
sample means over many draws must land on the closed-form KL. The controller follows
Ziegler et al. 2019: e = clip(KL/target - 1, -0.2, 0.2), beta <- beta (1 + e n / horizon).
"""

from __future__ import annotations

import math

import pytest
import torch

from ppo_core.ppo.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalty_per_token,
    make_kl_controller,
)

P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
Q = torch.tensor([0.1, 0.3, 0.2, 0.2, 0.2], dtype=torch.float64)


def exact_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p * (p / q).log()).sum())


def test_k1_and_k3_sample_means_match_exact_forward_kl() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 400_000
    tokens = torch.multinomial(P, n, replacement=True, generator=gen)
    logp, logq = P.log()[tokens], Q.log()[tokens]
    forward, backward = exact_kl(P, Q), exact_kl(Q, P)
    # the two directions differ by far more than the tolerance: the test tells them apart
    assert abs(forward - backward) > 0.1
    for estimator in ("k1", "k3"):
        est = kl_estimate(logp, logq, estimator)
        stderr = float(est.std()) / math.sqrt(n)
        assert float(est.mean()) == pytest.approx(forward, abs=max(5 * stderr, 1e-3)), estimator


def test_k3_is_nonnegative_pointwise_and_k2_is_half_k1_squared() -> None:
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(10_000, generator=gen, dtype=torch.float64) * 3
    logq = torch.randn(10_000, generator=gen, dtype=torch.float64) * 3
    k1, k2, k3 = (kl_estimate(logp, logq, e) for e in ("k1", "k2", "k3"))
    assert torch.all(k3 >= 0)
    assert (k1 < 0).any()  # k1 can be negative per token; k3 cannot
    torch.testing.assert_close(k2, 0.5 * k1**2)
    torch.testing.assert_close(k1, logp - logq)
    # k3 = (q/p - 1) - log(q/p), written out
    torch.testing.assert_close(k3, (logq - logp).exp() - 1 - (logq - logp))


def test_all_estimators_are_zero_when_policies_agree() -> None:
    logp = -torch.rand(7) * 4
    for estimator in ("k1", "k2", "k3"):
        assert torch.all(kl_estimate(logp, logp.clone(), estimator) == 0)


def test_unknown_estimator_is_an_error() -> None:
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kl", "error"),
    [
        (12.0, 0.2),  # KL/target - 1 = 1.0 -> clipped to +0.2
        (0.0, -0.2),  # -1.0 -> clipped to -0.2
        (6.6, 0.1),  # inside the band: 6.6/6 - 1 = 0.1
        (4.8, -0.2),  # exactly -0.2
        (5.7, -0.05),
    ],
)
def test_adaptive_controller_update(kl: float, error: float) -> None:
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=1000)
    ctl.update(kl, n_steps=512)
    assert ctl.value == pytest.approx(0.1 * (1 + error * 512 / 1000), rel=1e-12)


def test_adaptive_controller_compounds_and_round_trips_state() -> None:
    ctl = make_kl_controller(0.2, target=1.0, horizon=100)
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(10.0, 50)  # +0.2 * 0.5 -> x1.1
    ctl.update(0.95, 50)  # -0.05 * 0.5 -> x0.975
    assert ctl.value == pytest.approx(0.2 * 1.1 * 0.975, rel=1e-12)
    other = AdaptiveKLController(1.0, 2.0, 3)
    other.load_state_dict(ctl.state_dict())
    assert other == ctl


def test_fixed_controller_never_moves() -> None:
    ctl = make_kl_controller(0.05, target=None, horizon=10)
    assert isinstance(ctl, FixedKLController)
    for kl in (0.0, 1e3, -5.0, 0.05):
        ctl.update(kl, 10_000)
    assert ctl.value == 0.05


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_loss_term_has_the_gradient_of_the_true_kl(estimator: str) -> None:
    """Tokens come from pi_old; the loss term's expected value and gradient over those samples
    must be KL(pi_theta || pi_ref) and its gradient, with pi_theta already moved off pi_old."""
    gen = torch.Generator().manual_seed(2)
    z_old = torch.randn(6, generator=gen, dtype=torch.float64)
    z_ref = torch.randn(6, generator=gen, dtype=torch.float64)
    z = (z_old + 0.3 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_(True)
    logp, log_old, log_ref = (
        torch.log_softmax(z, -1),
        torch.log_softmax(z_old, -1),
        torch.log_softmax(z_ref, -1),
    )
    per_token = kl_penalty_per_token(logp, log_old, log_ref, estimator)  # one entry per token a
    expected_loss = (log_old.exp() * per_token).sum()  # E_{a ~ pi_old}
    (grad,) = torch.autograd.grad(expected_loss, z, retain_graph=True)
    exact = (logp.exp() * (logp - log_ref)).sum()
    (exact_grad,) = torch.autograd.grad(exact, z)
    assert expected_loss.item() == pytest.approx(exact.item(), rel=1e-10)
    torch.testing.assert_close(grad, exact_grad, atol=1e-10, rtol=0)


def test_unweighted_k1_as_a_loss_would_ignore_the_reference() -> None:
    """Why the importance weight is there: grad E_{pi}[log pi(a) - log pi_ref(a)] with the samples
    held fixed is E[grad log pi] = 0, whatever pi_ref is."""
    z = torch.randn(6, dtype=torch.float64, requires_grad=True)
    for z_ref in (torch.zeros(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64) * 3):
        logp = torch.log_softmax(z, -1)
        naive = (logp.detach().exp() * kl_estimate(logp, torch.log_softmax(z_ref, -1), "k1")).sum()
        (grad,) = torch.autograd.grad(naive, z)
        assert grad.abs().max().item() < 1e-12
