"""Statistics over the valid (unmasked) entries of padded tensors.

Every PPO quantity lives on a ragged grid of response tokens padded to a rectangle; these
helpers make sure a pad never enters a mean, a variance or a normalisation.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid entries; 0 (not NaN) where nothing is valid."""
    mask = mask.to(x.dtype)
    total = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / total.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over valid entries (Bessel-corrected by default, as the reference implementations)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.to(x.dtype).sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / std over valid entries; with shift_mean=False the mean is added back.

    Rewards are whitened without a mean shift (shifting would change which responses the
    policy is pushed towards); advantages are fully whitened. Pads come out as 0.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    white = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return white * mask.to(x.dtype)
