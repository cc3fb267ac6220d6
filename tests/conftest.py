"""Shared fixtures of the ppo_core tests: tiny in-code models, a rule-based score, CPU only.

Everything runs on one or two CPU threads with fixed seeds so that the numbers the tests
compare (e.g. resumed vs uninterrupted runs) are reproducible on a shared machine.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ppo_core.config import DeviceConfig, SamplingConfig
from ppo_core.lm.rollout import Rollout, left_pad
from ppo_core.ppo.config import PPOConfig
from ppo_core.ppo.trainer import PPOTrainer
from ppo_core.ppo.value import CriticModel
from tests.tiny import tiny_llama, tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)

TARGET_TOKEN = 10
"""The token the programmatic reward counts (w6 in the tiny tokenizer)."""


def tiny_gpt2(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    """A tiny GPT-2 over the tiny vocabulary: absolute position embeddings (unlike RoPE, which
    is shift invariant) make it sensitive to wrong position ids, and it has nn.Dropout modules."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=44,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return GPT2LMHeadModel(config).eval()


def count_token_score(token_id: int = TARGET_TOKEN) -> Callable[[Rollout], torch.Tensor]:
    """Score = how many valid response tokens equal `token_id` (a learnable, dense-ish target)."""

    def score(rollout: Rollout) -> torch.Tensor:
        hits = (rollout.response_ids == token_id) & rollout.response_mask.bool()
        return hits.sum(1).float()

    return score


def make_prompts(n: int = 16, seed: int = 0, min_len: int = 2, max_len: int = 6) -> list[list[int]]:
    """Prompts of ragged length over the word tokens (ids 4..43), so batches are left-padded."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    return [torch.randint(4, 44, (int(k),), generator=gen).tolist() for k in lengths]


def build_trainer(
    config: PPOConfig | None = None,
    sampling: SamplingConfig | None = None,
    score_fn: Callable[[Rollout], torch.Tensor] | None = None,
    prompts: list[list[int]] | None = None,
    seed: int = 0,
    precision: str = "fp32",
    **config_overrides: Any,
) -> PPOTrainer:
    """A PPOTrainer over tiny Llamas: policy and reference share their init, the critic copies
    the policy trunk (the usual RLHF set-up, scaled down to run in a second)."""
    if config is None:
        defaults: dict[str, Any] = {
            "batch_size": 8,
            "num_mini_batches": 2,
            "ppo_epochs": 2,
            "learning_rate": 3e-3,
            "lr_schedule": "constant",
            "seed": seed,
        }
        defaults.update(config_overrides)
        config = PPOConfig(**defaults)
    sampling = sampling or SamplingConfig(max_new_tokens=6)
    policy = tiny_llama(seed=seed)
    ref = tiny_llama(seed=seed)
    critic = CriticModel.from_model(policy) if config.critic == "separate" else None
    return PPOTrainer(
        config,
        sampling,
        policy,
        ref,
        critic,
        tiny_tokenizer(),
        score_fn or count_token_score(),
        prompts if prompts is not None else make_prompts(),
        device=DeviceConfig(device="cpu", precision=precision),
    )


CHAINS = {"main_folder": "pipeline-main", "crashed_run": "pipeline-crashed", "damaged_run": "pipeline-damaged"}
"""Session fixtures (tests/pipeline_fixtures.py) whose runs build on each other: every test that
uses one runs in the same xdist worker, so each chain runs once."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `pytest -n N --dist loadgroup` (scripts/test.sh) a group runs whole in one worker:
    the tests of one pipeline chain, else those of one module (its module fixtures run once)."""
    groups = {}
    for item in items:
        closure = getattr(item, "fixturenames", ())
        chain = next((group for name, group in CHAINS.items() if name in closure), None)
        groups[item] = chain or item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    if hasattr(config, "workerinput"):  # an xdist worker: groups with slow tests first, the
        # quick ones then fill the gaps at the end (a stable sort keeps each group's order)
        slow = {groups[item] for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: groups[item] not in slow)


@pytest.fixture(autouse=True)
def _seed_everything() -> Iterator[None]:
    """Every test starts from the same RNG state, whatever ran before it."""
    torch.manual_seed(0)
    random.seed(0)
    yield


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def policy():
    return tiny_llama(seed=0)


@pytest.fixture
def score_fn() -> Callable[[Rollout], torch.Tensor]:
    return count_token_score()


@pytest.fixture
def trainer_factory() -> Callable[..., PPOTrainer]:
    return build_trainer


def padded_pair() -> tuple[Rollout, Rollout]:
    """The same short sequence alone, and beside a longer one in a left/right padded batch.

    Row 0 of the batch is the short sequence: 3 prompt tokens behind 3 left pads, 2 response
    tokens (ending in EOS) followed by 3 right pads. Row 1 fills the rectangle.
    """
    short_q, short_r = [7, 20, 33], [12, 1]
    long_q, long_r = [5, 9, 14, 22, 30, 41], [8, 15, 16, 23, 42]
    query_ids, query_mask = left_pad([short_q, long_q], pad_id=0)
    response_ids = torch.tensor([[*short_r, 0, 0, 0], long_r])
    response_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    batch = Rollout(query_ids, query_mask, response_ids, response_mask, torch.tensor([True, False]))
    alone = Rollout(
        torch.tensor([short_q]),
        torch.ones(1, 3, dtype=torch.long),
        torch.tensor([short_r]),
        torch.ones(1, 2, dtype=torch.long),
        torch.tensor([True]),
    )
    return alone, batch
