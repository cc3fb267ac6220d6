"""Statistics over the valid (unmasked) entries of padded tensors.

Every PPO quantity lives on a ragged grid of response tokens padded to a rectangle; these
helpers make sure a pad never enters a mean, a variance or a normalisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid entries; 0 (not NaN) where nothing is valid."""
    mask = mask.to(x.dtype)
    total = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / total.clamp(min=1.0)


Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over data-parallel ranks (identity in one process): whitening statistics then
cover the global batch."""


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    return t


def masked_moments(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, reduce: Reduce = no_reduce
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance over valid entries (Bessel-corrected by default, as the reference
    implementations), built from sums passed through `reduce`: with `DataParallel.sum` they
    are those of the whole batch across processes."""
    m = mask.to(x.dtype)
    total, n = reduce(torch.stack([(x * m).sum(), m.sum()])).unbind()
    mean = total / n.clamp(min=1.0)
    var = reduce(((x - mean) ** 2 * m).sum()) / n.clamp(min=1.0)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return mean, var


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    return masked_moments(x, mask, unbiased)[1]


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    reduce: Reduce = no_reduce,
) -> torch.Tensor:
    """(x - mean) / std over valid entries; with shift_mean=False the mean is added back.

    Rewards are whitened without a mean shift (shifting would change which responses the
    policy is pushed towards); advantages are fully whitened. Pads come out as 0. `reduce`: see
    masked_moments.
    """
    mean, var = masked_moments(x, mask, reduce=reduce)
    white = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return white * mask.to(x.dtype)
