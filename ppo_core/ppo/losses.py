"""The PPO objective, one small function per symbol.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. (7):
    rho_t(theta) = pi_theta(a_t|s_t) / pi_theta_old(a_t|s_t)
    L^CLIP = E_t[ min(rho_t A_t, clip(rho_t, 1-eps, 1+eps) A_t) ]
We minimise -L^CLIP. E_t is the mean over every valid response token of the minibatch
(token-level averaging); `normaliser` lets gradient-accumulation micro-batches divide by the
minibatch's token count so that accumulation equals one big batch exactly.
"""

from __future__ import annotations

import torch

from ppo_core.lm.masked import masked_mean, masked_sum, masked_var


def _token_mean(x: torch.Tensor, mask: torch.Tensor, normaliser: float | None) -> torch.Tensor:
    if normaliser is None:
        return masked_mean(x, mask)
    return masked_sum(x, mask) / normaliser


def ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """rho_t = exp(log pi_theta - log pi_theta_old)."""
    return torch.exp(logprobs - old_logprobs)


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-L^CLIP and its diagnostics (approx KL k3, clip fraction, ratio stats)."""
    rho = ratio(logprobs, old_logprobs)
    unclipped = -advantages * rho
    clipped = -advantages * torch.clamp(rho, 1.0 - cliprange, 1.0 + cliprange)
    loss = _token_mean(torch.maximum(unclipped, clipped), mask, normaliser)
    with torch.no_grad():
        log_rho = logprobs - old_logprobs
        stats = {
            "approxkl": masked_mean(torch.expm1(log_rho) - log_rho, mask),
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "ratio_mean": masked_mean(rho, mask),
            "ratio_max": torch.where(mask.bool(), rho, torch.zeros_like(rho)).max(),
        }
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2), the pessimistic clipped value loss."""
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        per_token = unclipped
        clipfrac = torch.zeros((), device=values.device)
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
        clipped = (v_clipped - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clipfrac = masked_mean((clipped > unclipped).float(), mask)
    loss = 0.5 * _token_mean(per_token, mask, normaliser)
    return loss, {"clipfrac": clipfrac}


def entropy_from_logits(logits: torch.Tensor, logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """H = logsumexp(l) - sum softmax(l) * l, per position, without a log-softmax copy; pass
    `logsumexp` when the caller has it already (softmax(l) = exp(l - logsumexp(l)))."""
    lse = torch.logsumexp(logits, dim=-1) if logsumexp is None else logsumexp
    probs = (logits - lse.unsqueeze(-1)).exp()
    return lse - (probs * logits).sum(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R]: 1 is a perfect critic, 0 no better than a constant, < 0 worse."""
    var_returns = masked_var(returns, mask)
    if var_returns <= 0:
        return torch.zeros((), device=values.device)
    return 1.0 - masked_var(returns - values, mask) / var_returns
