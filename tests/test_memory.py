"""ppo_core.ppo.memory: every component of the PPO memory estimate against numbers counted by
hand on a tiny Llama, and `rlhf validate` printing (and, on a GPU too small, refusing) it.

The tiny Llama (vocab 100, hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 KV heads, untied):
  embeddings 100*32 = 3,200; per layer q 32*32 + k 32*16 + v 32*16 + o 32*32 + gate, up, down
  3 * 32*64 + two norms 2*32 = 9,280; final norm 32; LM head 3,200
  -> 3,200 + 2 * 9,280 + 32 + 3,200 = 24,992 parameters; trunk (no LM head) 21,792;
  sequence classifier: trunk + a 32 -> 1 score layer without bias = 21,824.
Activation elements per token and layer: 4h + 5*a*d + 4I = 128 + 160 + 256 = 544.
"""

from __future__ import annotations

import copy
import mmap
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
)

from ppo_core.config import SamplingConfig
from ppo_core.lm.lora import LoRAConfig
from ppo_core.ppo.config import PPOConfig
from ppo_core.ppo.memory import (
    MemoryEstimate,
    TrunkShape,
    activation_bytes,
    estimate_ppo_memory,
    format_estimate,
    guess_prompt_tokens,
    kv_cache_bytes,
    layer_activation_elements,
    lora_param_count,
    param_count,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = LlamaConfig(
    vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
)
REWARD_CONFIG = copy.deepcopy(CONFIG)
REWARD_CONFIG.num_labels = 1  # as RewardModel.from_pretrained builds it
POLICY, TRUNK, REWARD, LAYER = 24_992, 21_792, 21_824, 544


def skeleton(cls=LlamaForCausalLM, config=CONFIG):
    with torch.device("meta"):
        return cls(config)


def estimate(**kwargs) -> MemoryEstimate:
    """Batch 8 in 2 minibatches (4 training rows), 10 prompt + 6 new tokens, separate critic."""
    algo = PPOConfig(batch_size=8, num_mini_batches=2, **kwargs.pop("algo", {}))
    return estimate_ppo_memory(
        skeleton(), skeleton(LlamaForSequenceClassification, REWARD_CONFIG), algo, SamplingConfig(max_new_tokens=6), 10, **kwargs
    )


def test_parameter_counts_of_the_skeletons() -> None:
    assert param_count(skeleton()) == POLICY
    assert param_count(skeleton(LlamaModel)) == TRUNK
    assert param_count(skeleton(LlamaForSequenceClassification, REWARD_CONFIG)) == REWARD
    tied = LlamaConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True})
    assert param_count(skeleton(config=tied)) == POLICY - 3_200  # the LM head is the embedding


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (None, 2 * (4 * (32 + 32) + 4 * (32 + 16))),  # peft's Llama default: q_proj, v_proj
        (["o_proj"], 2 * 4 * (32 + 32)),
        ("all-linear", 2 * 4 * (2 * 64 + 2 * 48 + 3 * 96)),  # q o | k v | gate up down; no LM head
    ],
)
def test_lora_adapter_counts_by_hand_and_as_peft_builds_them(targets, expected: int) -> None:
    from peft import get_peft_model

    lora = LoRAConfig(r=4, target_modules=targets)
    assert lora_param_count(skeleton(), lora) == expected
    torch.manual_seed(0)
    peft_model = get_peft_model(LlamaForCausalLM(CONFIG), lora.peft_config("CAUSAL_LM"))
    assert sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n) == expected


def test_trunk_shape_and_the_per_layer_activation_formula() -> None:
    shape = TrunkShape.of(skeleton())
    assert shape == TrunkShape(2, 32, 64, 4, 2, 8, True, False, 100)
    assert layer_activation_elements(shape, seq=16) == LAYER
    eager = TrunkShape(**{**vars(shape), "eager_attention": True})
    assert layer_activation_elements(eager, seq=16) == LAYER + 4 * 16  # + a * s probabilities


def test_a_gpt_layer_gives_korthikantis_34_h_bytes_per_token() -> None:
    gpt = skeleton(GPT2LMHeadModel, GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=50))
    shape = TrunkShape.of(gpt)
    assert (shape.layers, shape.intermediate, shape.gated_mlp, shape.kv_heads) == (3, 256, False, 4)
    assert 2 * layer_activation_elements(shape, seq=100) == 34 * 64


def test_gradient_checkpointing_keeps_layer_inputs_and_one_layer() -> None:
    shape = TrunkShape.of(skeleton())
    full = activation_bytes(shape, tokens=20, seq=10, elem_bytes=4, checkpointing=False)
    ckpt = activation_bytes(shape, tokens=20, seq=10, elem_bytes=4, checkpointing=True)
    assert full == 20 * (2 * LAYER + 2 * 32) * 4 == 92_160
    assert ckpt == 20 * (2 * 32 + LAYER + 2 * 32) * 4 == 53_760
    assert estimate(gradient_checkpointing=True).activations < estimate().activations


def test_packing_runs_the_shared_prompt_prefix_once_per_packed_row() -> None:
    # 4 rows of 16 tokens sharing a 4-token prefix: 4 x 12 = 48 tokens, packed rows of about
    # max(16, hidden 32) tokens -> ceil(48 / 28) = 2 packed rows, each with its prefix: 56 tokens
    packed = estimate(shared_prefix_tokens=4)
    assert packed.activations == 2 * 56 * (2 * LAYER + 64) * 4
    assert estimate(shared_prefix_tokens=4, algo={"pack_sequences": False}).activations == estimate().activations
    assert estimate(shared_prefix_tokens=4).kv_cache == estimate().kv_cache  # generation runs every row whole


def test_kv_cache_formula() -> None:
    assert kv_cache_bytes(TrunkShape.of(skeleton()), rows=8, seq=16, elem_bytes=2) == 2 * 2 * 2 * 8 * 16 * 8 * 2


def test_full_fine_tuning_with_a_separate_critic_component_by_component() -> None:
    critic, trainable = TRUNK + 33, POLICY + TRUNK + 33  # the critic: policy trunk + value head 32 -> 1
    assert estimate() == MemoryEstimate(
        policy_weights=POLICY * 4,
        reference_weights=POLICY * 4,
        critic_weights=critic * 4,
        reward_weights=REWARD * 4,
        optimizer=2 * trainable * 4,
        kv_cache=2 * 2 * 2 * 8 * 16 * 8 * 4,  # 8 rollout rows of 16 tokens, fp32
        generation_logits=4 * 8 * 100 * 4,  # one sampling step of 8 rows
        gradients=trainable * 4,
        activations=2 * 4 * 16 * (2 * LAYER + 64) * 4,  # policy and critic trunks, 4 rows x 16
        logits=3 * 4 * 7 * 100 * 4,  # response positions + 1
        master_weights=0,
        master_gradients=0,
        gathered_for_generation=0,
        gathered_for_update=0,
    )
    assert estimate().total == 749_068 + max(32_768 + 57_600, 187_268 + 589_824 + 33_600) == 1_559_760


def test_shared_critic_is_a_head_on_the_policy() -> None:
    shared = estimate(algo={"critic": "shared"})
    assert (shared.policy_weights, shared.critic_weights) == ((POLICY + 33) * 4, 0)
    assert shared.gradients == (POLICY + 33) * 4
    assert shared.activations == 4 * 16 * (2 * LAYER + 64) * 4  # one trunk


def test_lora_trains_adapters_only_and_needs_no_reference_copy() -> None:
    lora = estimate(lora=LoRAConfig(r=4))
    adapters = 2 * (4 * 64 + 4 * 48)  # per model (the critic's backbone gets its own)
    assert lora.reference_weights == 0
    assert lora.policy_weights == (POLICY + adapters) * 4
    assert lora.critic_weights == (TRUNK + adapters + 33) * 4
    assert lora.gradients == (2 * adapters + 33) * 4
    assert lora.optimizer == 2 * lora.gradients


def test_sharding_divides_the_trained_models_and_processes_split_the_batch() -> None:
    whole, sharded = estimate(), estimate(shards=2)
    for name in ("policy_weights", "critic_weights", "gradients", "optimizer"):
        assert getattr(sharded, name) == getattr(whole, name) // 2, name
    assert (sharded.reference_weights, sharded.reward_weights) == (whole.reference_weights, whole.reward_weights)
    two_ranks = estimate(processes=2)
    assert two_ranks.kv_cache == whole.kv_cache // 2  # 4 rollout rows per rank
    assert two_ranks.activations == whole.activations // 2  # 2 of the minibatch's 4 rows per rank


def test_sharded_weights_are_gathered_whole_to_generate_and_by_unit_to_train() -> None:
    assert (estimate().gathered_for_generation, estimate().gathered_for_update) == (0, 0)
    sharded = estimate(shards=2)
    critic = TRUNK + 33
    assert sharded.gathered_for_generation == (POLICY + critic) * 4
    # outside the blocks: policy 3,200 + 32 + 3,200, critic 3,200 + 32 + 33; and two blocks of 9,280
    assert sharded.gathered_for_update == (6_432 + 3_265 + 2 * 9_280) * 4
    assert sharded.generation == sharded.kv_cache + sharded.generation_logits + sharded.gathered_for_generation
    mixed = estimate(shards=2, compute_dtype_bytes=2)  # FSDP's mixed precision: fp32 shards, bf16 gathers
    assert (mixed.gathered_for_generation, mixed.policy_weights, mixed.master_weights) == ((POLICY + critic) * 2, POLICY * 2, 0)


def test_dtypes_frozen_models_in_bf16_and_bf16_compute_with_fp32_masters() -> None:
    whole, frozen = estimate(), estimate(frozen_dtype_bytes=2)
    assert (frozen.reference_weights, frozen.reward_weights) == (POLICY * 2, REWARD * 2)
    assert frozen.policy_weights == whole.policy_weights
    mixed, trainable = estimate(compute_dtype_bytes=2), POLICY + TRUNK + 33
    assert (mixed.activations, mixed.kv_cache) == (whole.activations // 2, whole.kv_cache // 2)
    assert (mixed.policy_weights, mixed.critic_weights, mixed.gradients) == (POLICY * 2, (TRUNK + 33) * 2, trainable * 2)
    assert mixed.master_weights == mixed.master_gradients == trainable * 4  # fp32 masters and their gradients
    assert mixed.optimizer == whole.optimizer
    assert mixed.update == max(mixed.gradients + mixed.activations + mixed.logits, trainable * 4)


def test_critic_from_the_reward_model_uses_its_backbone() -> None:
    backbone = skeleton(LlamaModel, LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 1}))
    assert estimate(critic_backbone=backbone).critic_weights == (3_200 + 9_280 + 32 + 33) * 4


def test_prompt_tokens_guessed_from_bytes() -> None:
    assert guess_prompt_tokens(["abcdefg", "ab"], None, chat_template=False) == 3  # ceil(7 / 3)
    assert guess_prompt_tokens(["abcdefg"], "sys", chat_template=True) == 4 + 32
    assert guess_prompt_tokens(["é"], None, chat_template=False) == 1  # 2 UTF-8 bytes


def test_the_table_has_one_line_per_component_and_the_peak() -> None:
    lines = format_estimate(estimate()).splitlines()
    assert len(lines) == 14 + 4
    assert lines[0] == "  policy weights" + " " * 12 + "97.62 KiB"
    assert lines[-1] == "  peak" + " " * 23 + "1.49 MiB   resident + max(generation, update)"


# ---- rlhf validate -------------------------------------------------------------------------
def _tiny_estimate_table(tiny_dir: Path, monkeypatch) -> str:
    from flows.config import load_config
    from ppo_core.data.prompts import load_prompts
    from ppo_core.lm.models import model_skeleton
    from ppo_core.ppo.memory import reward_skeletons

    monkeypatch.setenv("RLHF_TINY_DIR", str(tiny_dir))
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    prompt_tokens = guess_prompt_tokens(load_prompts(cfg.prompts), None, True)
    assert prompt_tokens == 42  # the longest tiny prompt, 28 bytes: ceil(28 / 3) + 32
    expected = estimate_ppo_memory(
        model_skeleton("tiny:llama"), reward_skeletons("tiny:llama")[0], cfg.ppo.effective_algo,
        cfg.ppo.sampling, prompt_tokens,
    )
    assert expected.policy_weights == 22_432 * 4  # tiny:llama: vocab 60, hidden 32, 2 layers, untied
    return format_estimate(expected)


def test_validate_prints_the_estimate_after_the_ok_line(tmp_path: Path, monkeypatch) -> None:
    env = {**os.environ, "RLHF_TINY_DIR": str(tmp_path / "tiny"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "validate", str(REPO / "configs" / "tiny.yaml"),
         "--set", "orchestration.device.precision=fp32"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].endswith("OK (pipeline 'tiny', 2 PPO rounds x 2 iterations)")
    assert lines[1] == ("estimated peak per device for a PPO round (CPU, prompt <= 42 tokens "
                        "(guessed from the longest prompt's length in bytes) + 6 new):")
    assert "\n".join(lines[2:]) == _tiny_estimate_table(tmp_path / "tiny", monkeypatch)
    assert "  policy weights" + " " * 12 + "87.62 KiB" in lines


def _fake_gpu(monkeypatch, total_memory: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "a fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=total_memory))


@pytest.mark.parametrize(("device", "gib", "exit_code"), [("auto", 1 / 1024, 2), ("auto", 80, 0), ("cpu", 1 / 1024, 0)])
def test_validate_refuses_a_round_that_cannot_fit_the_gpu(tmp_path: Path, monkeypatch, device: str, gib: float, exit_code: int) -> None:
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.setenv("RLHF_TINY_DIR", str(tmp_path / "tiny"))
    _fake_gpu(monkeypatch, int(gib * 2**30))
    config = str(REPO / "configs" / "tiny.yaml")
    result = CliRunner().invoke(app, ["validate", config, "--set", f"orchestration.device.device={device}"])
    assert result.exit_code == exit_code, result.output
    assert ("(CUDA, " in result.stdout) == (device == "auto")
    peak = next(line for line in result.stdout.splitlines() if line.startswith("  peak ")).split()[1:3]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ([
        f"error: ppo: the estimated peak of {' '.join(peak)} per device exceeds the GPU's 1.00 MiB; change "
        "ppo.algo.micro_batch_size, orchestration.device.gradient_checkpointing, ppo.lora or ppo.processes "
        "(with ppo.sharding: fsdp)"
    ] if exit_code else [])


def test_validate_without_an_estimate_for_a_model_it_cannot_build_still_passes(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.setenv("RLHF_TINY_DIR", str(tmp_path / "tiny"))
    folder = tmp_path / "odd-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # resolves as a model folder; no architecture in it
    result = CliRunner().invoke(app, ["validate", str(REPO / "configs" / "tiny.yaml"), "--set", f"model.source={folder}"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith("memory estimate: not available (ValueError: ")


def test_peak_memory_sees_a_freed_allocation_and_resets() -> None:
    """PeakMemory (the pipeline's per-stage peak): 256 MiB touched and freed inside the measured
    stretch show in its peak; a new start forgets them."""
    from ppo_core.lm.peak_memory import PeakMemory, rss_bytes

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no resettable RSS high-water mark (not Linux)")
    before = rss_bytes() / 2**20
    meter = PeakMemory().start()
    # An anonymous mapping, so that closing it surely hands the pages back: a malloc'd block
    # (torch.ones) can be carved from a free stretch of glibc's heap that malloc_trim had
    # released, and its pages then stay resident after the free (seen once in CI).
    block = mmap.mmap(-1, 256 * 2**20)
    pages = torch.frombuffer(block, dtype=torch.uint8)
    pages.fill_(1)  # every page written
    del pages
    block.close()
    after = rss_bytes() / 2**20
    peak = meter.read()["peak_rss_mib"]
    assert peak >= before + 250, (before, peak)
    assert after < peak - 200, (after, peak)  # the premise: the block's pages are gone
    again = PeakMemory().start().read()["peak_rss_mib"]
    assert again < peak - 200, (again, peak)

