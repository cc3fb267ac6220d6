"""The KL leash to the frozen reference policy, and the controllers of its coefficient beta.

Per-token estimators of KL(pi || pi_ref) from samples a_t ~ pi, with log r_t = log pi(a_t|s_t) -
log pi_ref(a_t|s_t) (J. Schulman, "Approximating KL divergence", 2020):
    k1 = log r               unbiased, high variance, can be negative per token
    k2 = (log r)^2 / 2       biased, low variance, always >= 0
    k3 = (r^-1 - 1) + log r  unbiased, low variance, always >= 0 (here r^-1 = pi_ref/pi)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k1"
) -> torch.Tensor:
    """Per-token KL estimate; same shape as the inputs (mask it yourself)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def kl_penalty_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """rho_t * k_t, the KL term for use as a *loss* (KLConfig.in_reward=False).

    The tokens were sampled from pi_old, not pi_theta, so the estimator is importance-weighted
    with rho_t = pi_theta/pi_old: E_{pi_old}[rho k] = E_{pi_theta}[k], which for k1 and k3 is
    KL(pi_theta || pi_ref) at every theta, and so is its gradient. Unweighted k1 would be wrong
    as a loss: its gradient sum_t grad log pi_theta(a_t) ignores pi_ref entirely (zero in
    expectation on-policy; it only lowers the likelihood of the sampled tokens).
    """
    rho = torch.exp(logprobs - old_logprobs)
    return rho * kl_estimate(logprobs, ref_logprobs, estimator)


@dataclass
class FixedKLController:
    """beta stays where it was set."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        return None

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", eq. (2):

        e_t = clip(KL_t / KL_target - 1, -0.2, 0.2);   beta_{t+1} = beta_t (1 + K_beta e_t)

    with K_beta = n_steps / horizon, n_steps the number of samples in the batch.
    """

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(init_coef: float, target: float | None, horizon: int) -> KLController:
    if target is None:
        return FixedKLController(init_coef)
    return AdaptiveKLController(init_coef, target, horizon)
