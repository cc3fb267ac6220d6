"""Config validation (ppo_core.config): bad values fail at construction, naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ppo_core.config import DeviceConfig, SamplingConfig
from ppo_core.ppo.config import KLConfig, PPOConfig


def _error(model: type, **kwargs) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        model(**kwargs)
    return info.value


def _locs(error: ValidationError) -> list[tuple]:
    return [tuple(e["loc"]) for e in error.errors()]


@pytest.mark.parametrize("value", [0.0, -0.1])
def test_cliprange_must_be_positive(value: float) -> None:
    err = _error(PPOConfig, cliprange=value)
    assert _locs(err) == [("cliprange",)]
    assert "cliprange" in str(err)


def test_lam_above_one_is_rejected() -> None:
    err = _error(PPOConfig, lam=1.01)
    assert _locs(err) == [("lam",)] and "lam" in str(err)
    assert PPOConfig(lam=1.0).lam == 1.0 and PPOConfig(lam=0.0).lam == 0.0


def test_batch_must_divide_into_minibatches_and_microbatches() -> None:
    err = _error(PPOConfig, batch_size=10, num_mini_batches=3)
    assert "batch_size" in str(err) and "num_mini_batches" in str(err)
    err = _error(PPOConfig, batch_size=8, num_mini_batches=2, micro_batch_size=3)
    assert "micro_batch_size" in str(err)
    ok = PPOConfig(batch_size=8, num_mini_batches=2, micro_batch_size=2)
    assert ok.mini_batch_size == 4 and ok.effective_micro_batch_size == 2
    assert PPOConfig(batch_size=8, num_mini_batches=4).effective_micro_batch_size == 2


def test_unknown_keys_are_errors_at_every_level() -> None:
    err = _error(PPOConfig, clip_range=0.2)
    assert _locs(err) == [("clip_range",)] and "clip_range" in str(err)
    err = _error(PPOConfig, kl={"init_coef": 0.1, "targt": 6.0})
    assert _locs(err) == [("kl", "targt")]
    assert _locs(_error(SamplingConfig, temp=0.7)) == [("temp",)]
    assert _locs(_error(DeviceConfig, gpu=True)) == [("gpu",)]


def test_assignment_is_validated_too() -> None:
    config = PPOConfig()
    with pytest.raises(ValidationError, match="cliprange"):
        config.cliprange = -1.0


def test_other_ranges() -> None:
    assert _locs(_error(KLConfig, estimator="k4")) == [("estimator",)]
    assert _locs(_error(KLConfig, target=0.0)) == [("target",)]
    assert _locs(_error(PPOConfig, gamma=1.5)) == [("gamma",)]
    assert _locs(_error(SamplingConfig, temperature=0.0)) == [("temperature",)]
    err = _error(SamplingConfig, max_new_tokens=4, min_new_tokens=5)
    assert "min_new_tokens" in str(err) and "max_new_tokens" in str(err)
