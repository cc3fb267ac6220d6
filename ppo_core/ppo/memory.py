"""Peak memory per device of a PPO round, estimated from model structure and settings alone.

Nothing is loaded: parameter counts come from weightless skeletons (`model_skeleton`, built on
the meta device) and every other term from the config. A round has two memory phases, and the
peak is the larger of the two on top of what stays resident:

    resident   = weights (policy, reference, critic, reward model, fp32 masters) + AdamW states
    generation = KV cache + the generation logits kept for the old log-probs (+ FSDP gathers)
    update     = max(gradients + saved activations + LM-head logits (+ FSDP gathers),
                     the fp32 masters' gradients)
    total      = resident + max(generation, update)

(gradients are freed after every optimizer step and the KV cache when sampling ends; the
scoring forwards in between hold less than the update). Per component, in bytes:

- weights: the trained models' parameters x `compute_dtype_bytes`; in bf16 (2) their trainable
  ones also have fp32 masters (ppo_core.lm.precision.MasterWeights: 4 bytes each, the weights
  AdamW steps, with fp32 gradients once a minibatch's bf16 gradients move to them); frozen
  models (the reference, the reward model) x `frozen_dtype_bytes`. LoRA: the reference is the policy's
  base with the adapters off, so it costs nothing; adapters add r x (in + out) per adapted
  linear layer (peft's lora_A is r x in, lora_B is out x r).
- gradients: 1 per trainable parameter in the compute dtype; optimizer: 2 fp32 (AdamW's
  exp_avg and exp_avg_sq). With `shards` = N (FSDP) the policy's and critic's weights (fp32
  shards), gradients and optimizer states are divided by N; frozen models stay whole on every
  rank (ppo_core.lm.sharding). Sharded weights are gathered whole while they compute, in the
  compute dtype (FSDP's mixed precision): `gathered_for_generation`, the whole policy and critic
  for generation and scoring; `gathered_for_update`, the root group (everything outside the
  transformer blocks: embeddings, norms, heads) and two blocks (the running one and the
  prefetched one).
- KV cache: 2 (K and V) x layers x kv_heads x head_dim x (prompt + new tokens) x rollout rows
  per rank x compute bytes (activations too are in the compute dtype).
- generation logits: rows x vocab x 4 of one sampling step, `GENERATION_LOGIT_COPIES` times
  (the fp32 logits, the scores divided by the temperature, their softmax and its cumulative
  sum, or the log-softmax of the sampled token's log-prob); no earlier step's are kept.
- activations: what autograd saves in the training forward of one micro-batch, per layer and
  token: Korthikanti et al. 2022's count (arXiv:2205.05198, sec. 4.1), redone for Hugging Face
  decoders (`layer_activation_elements`); it matches autograd's saved tensors on SmolLM2 to
  3-7%. With gradient checkpointing each layer keeps only its input (h per token), plus one
  layer's full set during the recompute. Tokens: every row at the longest prompt and all new
  tokens, less what packing (the default) saves on the prefix all prompts share when the
  caller knows it (`shared_prefix_tokens`): a bound, as real rows are shorter and packing drops
  their padding. A bound under LoRA too: a frozen linear layer keeps no input (q, v adapters
  only: ~25% fewer saved elements on SmolLM2).
- logits: the LM head runs on the response positions only (ppo_core.lm.packing), so rows x
  (new tokens + 1) x vocab x 4 bytes, `TRAINING_LOGIT_COPIES` times (the saved logits, the
  softmax-shaped gradient of the log-softmax, and the head output's gradient).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

from ppo_core.config import SamplingConfig
from ppo_core.data.config import PromptConfig
from ppo_core.data.prompts import BUILTIN, load_prompts
from ppo_core.data.records import is_local_file
from ppo_core.lm.lora import LoRAConfig
from ppo_core.lm.models import _pretrained_args, resolve_source, transformer_blocks, trunk
from ppo_core.lm.packing import ADDITIVE_MASK_ATTENTION
from ppo_core.ppo.config import PPOConfig

FP32 = 4
ADAM_STATES = 2
GENERATION_LOGIT_COPIES = 4
TRAINING_LOGIT_COPIES = 3
CHARS_PER_TOKEN = 3
"""Prompt tokens guessed from text: English BPE averages ~4 UTF-8 bytes a token; 3 errs high."""
CHAT_TEMPLATE_TOKENS = 32
"""Allowance for a chat template's markup (SmolLM2's, with its default system prompt: 30)."""
ASSUMED_PROMPT_TOKENS = 256


# ---- the models' shapes ------------------------------------------------------------------
@dataclass(frozen=True)
class TrunkShape:
    """What the KV-cache and activation formulas read from a transformer."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    gated_mlp: bool
    eager_attention: bool
    vocab: int

    @classmethod
    def of(cls, model: nn.Module) -> TrunkShape:
        config, blocks = model.config, transformer_blocks(model)
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        return cls(
            layers=len(blocks),
            hidden=hidden,
            intermediate=int(intermediate or 4 * hidden),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            gated_mlp=any("gate" in name for name, _ in blocks[0].named_modules()),
            eager_attention=getattr(config, "_attn_implementation", None) in ADDITIVE_MASK_ATTENTION,
            vocab=int(config.vocab_size),
        )


def param_count(module: nn.Module) -> int:
    """Parameters of `module`, tied ones (SmolLM2's embedding and LM head) counted once."""
    return sum(p.numel() for p in module.parameters())


def _linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of nn.Linear, or of GPT-2's Conv1D (weight in x out); None for other modules."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D":
        rows, cols = module.weight.shape
        return int(rows), int(cols)
    return None


def _lora_targets(model: nn.Module, lora: LoRAConfig) -> list[str] | None:
    """The target names as peft resolves them; None = every linear layer but the output head."""
    if lora.target_modules == "all-linear":
        return None
    if lora.target_modules is not None:
        return list(lora.target_modules)
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    return list(DEFAULTS[model.config.model_type])


def lora_param_count(model: nn.Module, lora: LoRAConfig) -> int:
    """Adapter parameters peft adds to `model`: r x (in + out) per targeted linear layer."""
    targets = _lora_targets(model, lora)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    total = 0
    for name, module in model.named_modules():
        dims = _linear_dims(module)
        if dims is None:
            continue
        hit = module is not head if targets is None else any(re.search(rf"(^|\.){re.escape(t)}$", name) for t in targets)
        total += lora.r * sum(dims) if hit else 0
    return total


def reward_skeletons(source: str, trust_remote_code: bool = False) -> tuple[nn.Module, nn.Module]:
    """(reward model, its bare backbone) on the meta device: the sequence classifier with one
    label that `RewardModel.from_pretrained` builds, and the `AutoModel` a critic initialised
    from the reward model (`ppo.critic_init: reward_model`) starts from."""
    location, kwargs = _pretrained_args(resolve_source(source), trust_remote_code)
    config = AutoConfig.from_pretrained(location, **kwargs)
    config.num_labels = 1
    with torch.device("meta"):
        classifier = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
        backbone = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    return classifier, backbone


# ---- per-component formulas ---------------------------------------------------------------
def layer_activation_elements(shape: TrunkShape, seq: int) -> int:
    """Elements autograd saves per token in one decoder layer's training forward.

    Korthikanti et al.'s count for a GPT layer, 34*h bytes per token at 2 bytes = 17*h elements
    (+ 5*a*s bytes of attention scores and dropout masks), taken module by module for Hugging
    Face decoders (no dropout, pre-norm):
      4h       two norms, each keeping its input and its normalised output (RMSNorm scales
               the normalised tensor by its weight, so both are saved);
      5*a*d    q, k, v as they enter attention (GQA keys and values are repeated to all `a`
               heads when a mask is passed, transformers' sdpa path), the attention output and
               the output projection's (contiguous) input;
      4I / 2I  a gated MLP keeps gate, act(gate), up and their product; a plain one fc1's
               output and the activation's;
      a*s      attention probabilities, only under eager attention (the model's or
               ppo_core.lm.attention; sdpa's fused kernels keep a log-sum-exp per row instead).
    A GPT-2 layer (I = 4h, a*d = h, plain MLP) gives 4h + 5h + 8h = 17h: Korthikanti's 34h.
    """
    h, ad = shape.hidden, shape.heads * shape.head_dim
    mlp = (4 if shape.gated_mlp else 2) * shape.intermediate
    scores = shape.heads * seq if shape.eager_attention else 0
    return 4 * h + 5 * ad + mlp + scores


def training_tokens(algo: PPOConfig, rows: int, seq: int, shared_prefix: int, hidden: int) -> int:
    """Tokens one training forward runs: the rectangle rows x seq, or packed
    (ppo_core.lm.packing) the rows behind one copy per packed row of the `shared_prefix` all
    prompts start with, packed rows holding about max(seq, hidden) tokens (`pack_budget`)."""
    if not algo.pack_sequences or shared_prefix == 0 or rows < 2:
        return rows * seq
    rest = rows * (seq - shared_prefix)
    packed_rows = min(rows, math.ceil(rest / max(max(seq, hidden) - shared_prefix, 1)))
    return rest + shared_prefix * packed_rows


def activation_bytes(shape: TrunkShape, tokens: int, seq: int, elem_bytes: int, checkpointing: bool) -> int:
    """Saved activations of one micro-batch of `tokens` tokens (rows of `seq`) through a whole
    trunk, plus the final norm's 2h per token. Checkpointed: each layer's input, and one layer
    in full."""
    per_layer = layer_activation_elements(shape, seq)
    layers = shape.layers * shape.hidden + per_layer if checkpointing else shape.layers * per_layer
    return tokens * (layers + 2 * shape.hidden) * elem_bytes


def kv_cache_bytes(shape: TrunkShape, rows: int, seq: int, elem_bytes: int) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * seq * rows * elem_bytes


def generation_logits_bytes(rows: int, vocab: int) -> int:
    """One sampling step's [rows, V] fp32 logits and their copies in the sampler (scores,
    softmax, cumulative sum, log-softmax: ppo_core.lm.decoding keeps no earlier step's)."""
    return rows * vocab * FP32 * GENERATION_LOGIT_COPIES


def training_rows(algo: PPOConfig, processes: int) -> int:
    """Rows of one training micro-batch on a rank: the micro-batch, or the rank's expected
    share of the minibatch (its rows are the minibatch members it rolled out)."""
    return min(algo.effective_micro_batch_size, math.ceil(algo.mini_batch_size / processes))


# ---- the estimate -------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device, one field per component; `total` is the peak (module docstring)."""

    policy_weights: int
    reference_weights: int
    critic_weights: int
    reward_weights: int
    optimizer: int
    kv_cache: int
    generation_logits: int
    gradients: int
    activations: int
    logits: int
    master_weights: int
    master_gradients: int
    gathered_for_generation: int
    gathered_for_update: int

    @property
    def resident(self) -> int:
        weights = self.policy_weights + self.reference_weights + self.critic_weights + self.reward_weights
        return weights + self.master_weights + self.optimizer

    @property
    def generation(self) -> int:
        return self.kv_cache + self.generation_logits + self.gathered_for_generation

    @property
    def update(self) -> int:
        backward = self.gradients + self.activations + self.logits + self.gathered_for_update
        return max(backward, self.master_gradients)

    @property
    def total(self) -> int:
        return self.resident + max(self.generation, self.update)


@dataclass(frozen=True)
class _Trained:
    """Parameter counts of one trained model: held (base, adapters, value head), trainable, in
    its transformer blocks, and in its largest block (FSDP's units)."""

    whole: int
    trainable: int
    in_blocks: int
    largest_block: int


def _trained(model: nn.Module, lora: LoRAConfig | None, head: int) -> _Trained:
    adapters = lora_param_count(model, lora) if lora else 0
    blocks = [param_count(block) for block in transformer_blocks(model)]
    trainable = adapters + head if lora else param_count(model) + head
    return _Trained(param_count(model) + adapters + head, trainable, sum(blocks), max(blocks))


def _trained_models(policy: nn.Module, critic_backbone: nn.Module | None, critic: str, lora: LoRAConfig | None) -> list[_Trained]:
    """The policy (with the shared value head, a Linear(hidden, 1)), then a separate critic: its
    backbone (the policy's trunk unless given) with its own head and adapters."""
    if critic == "shared":
        return [_trained(policy, lora, int(policy.config.hidden_size) + 1)]
    backbone = critic_backbone if critic_backbone is not None else trunk(policy)
    return [_trained(policy, lora, 0), _trained(backbone, lora, int(backbone.config.hidden_size) + 1)]


def _gathered(models: list[_Trained], shards: int, elem_bytes: int) -> tuple[int, int]:
    """FSDP's whole weights (generation, update): see the module docstring."""
    if shards == 1:
        return 0, 0
    root = sum(m.whole - m.in_blocks for m in models)
    return sum(m.whole for m in models) * elem_bytes, (root + 2 * max(m.largest_block for m in models)) * elem_bytes


def estimate_ppo_memory(
    policy: nn.Module,
    reward_model: nn.Module,
    algo: PPOConfig,
    sampling: SamplingConfig,
    prompt_tokens: int,
    *,
    critic_backbone: nn.Module | None = None,
    lora: LoRAConfig | None = None,
    processes: int = 1,
    shards: int = 1,
    shared_prefix_tokens: int = 0,
    frozen_dtype_bytes: int = FP32,
    compute_dtype_bytes: int = FP32,
    gradient_checkpointing: bool = False,
) -> MemoryEstimate:
    """Peak bytes per device of a PPO round (the module docstring has every formula).

    `policy` and `reward_model` are skeletons; `critic_backbone` the separate critic's backbone
    when it is not the policy's trunk (critic_init reward_model); `prompt_tokens` the longest
    prompt, `shared_prefix_tokens` the tokens every prompt starts with (packing runs them once
    per packed row; 0 counts every row whole); `processes` the data-parallel ranks (each rolls
    out batch_size / processes rows); `shards` the ranks the policy's and critic's parameters,
    gradients and optimizer states are split over (1 = replicated, as with DDP);
    `frozen_dtype_bytes` the weight size of the frozen models; `compute_dtype_bytes` the dtype the
    trained models compute in (2: bf16 weights with fp32 masters, or FSDP's bf16 gathers).
    """
    models = _trained_models(policy, critic_backbone, algo.critic, lora)
    whole, trainable = sum(m.whole for m in models), sum(m.trainable for m in models)
    shape = TrunkShape.of(policy)
    elem = compute_dtype_bytes
    held = FP32 if shards > 1 else elem  # FSDP keeps fp32 shards; else the weights are cast
    masters = trainable * FP32 if shards == 1 and elem < FP32 else 0
    rollout_rows, rows = algo.batch_size // processes, training_rows(algo, processes)
    seq = prompt_tokens + sampling.max_new_tokens
    tokens = training_tokens(algo, rows, seq, shared_prefix_tokens, shape.hidden)
    activations = activation_bytes(shape, tokens, seq, elem, gradient_checkpointing)
    if algo.critic == "separate":
        critic_shape = TrunkShape.of(critic_backbone) if critic_backbone is not None else shape
        activations += activation_bytes(critic_shape, tokens, seq, elem, gradient_checkpointing)
    for_generation, for_update = _gathered(models, shards, elem)
    return MemoryEstimate(
        policy_weights=models[0].whole * held // shards,
        reference_weights=0 if lora else param_count(policy) * frozen_dtype_bytes,
        critic_weights=(whole - models[0].whole) * held // shards,
        reward_weights=param_count(reward_model) * frozen_dtype_bytes,
        optimizer=ADAM_STATES * trainable * FP32 // shards,
        kv_cache=kv_cache_bytes(shape, rollout_rows, seq, elem),
        generation_logits=generation_logits_bytes(rollout_rows, shape.vocab),
        gradients=trainable * held // shards,
        activations=activations,
        logits=TRAINING_LOGIT_COPIES * rows * (sampling.max_new_tokens + 1) * shape.vocab * FP32,
        master_weights=masters,
        master_gradients=masters,
        gathered_for_generation=for_generation,
        gathered_for_update=for_update,
    )


def guess_prompt_tokens(texts: list[str], system_prompt: str | None = None, chat_template: bool = True) -> int:
    """A tokenizer-free bound on the longest prompt: its UTF-8 bytes (and the system prompt's)
    / CHARS_PER_TOKEN, plus CHAT_TEMPLATE_TOKENS for a chat template's markup."""
    longest = max((len(t.encode()) for t in texts), default=0) + len((system_prompt or "").encode())
    return math.ceil(longest / CHARS_PER_TOKEN) + (CHAT_TEMPLATE_TOKENS if chat_template else 0)


def prompt_tokens_of(cfg: PromptConfig) -> tuple[int, str]:
    """(longest prompt in tokens, how it was found) without a tokenizer (loading SmolLM2's from
    its GGUF file alone takes seconds): guessed from a local or built-in prompt file, or
    `ASSUMED_PROMPT_TOKENS` for a hub dataset or a dataset folder, which are not read here."""
    if cfg.source.startswith(BUILTIN) or is_local_file(cfg.source):
        tokens = guess_prompt_tokens(load_prompts(cfg), cfg.system_prompt, cfg.use_chat_template)
        return tokens, "guessed from the longest prompt's length in bytes"
    return ASSUMED_PROMPT_TOKENS, "assumed: the prompts are not read here"


# ---- the table ----------------------------------------------------------------------------
def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_estimate(estimate: MemoryEstimate) -> str:
    """The breakdown as a small table: one line per component, then the phases and the peak."""
    rows = [(f.name.replace("_", " "), getattr(estimate, f.name), "") for f in fields(estimate)] + [
        ("resident", estimate.resident, "weights + masters + optimizer"),
        ("generation", estimate.generation, "kv cache + generation logits + gathered"),
        ("update", estimate.update, "gradients + activations + logits + gathered, or master gradients"),
        ("peak", estimate.total, "resident + max(generation, update)"),
    ]
    return "\n".join(f"  {name:<24}{format_bytes(size):>11}   {note}".rstrip() for name, size, note in rows)
