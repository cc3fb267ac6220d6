#!/usr/bin/env bash
# The GPU checks, prepared for a machine with CUDA (the device tool's H200): one script, one call.
# Writes everything under ${OUT:-gpu-check}/ and prints a summary. Steps:
#   1. use the machine's Python when it already has torch/transformers/prefect/mlflow (a lent
#      device machine cannot reach PyPI: carry missing wheels, see the device tool's README),
#      else install into .venv (CUDA torch from PyPI when nvidia-smi exists; scripts/install.sh)
#   2. bench_ppo.py on SmolLM2-135M in bf16 on CUDA: seconds, tokens/s and peak memory per phase
#      (batch 8 as in the CPU figures, and batch 64)
#   3. the default pipeline on CUDA (precision auto resolves to bf16 there), wall time per
#      stage from MLflow, gold/KL from the evaluation report
# Usage: OUT=/path bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
nvidia-smi > "$OUT/nvidia-smi.txt"
if python3 -c "import torch, transformers, prefect, mlflow, gguf, vaderSentiment" 2>/dev/null; then
  PY=python3
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  bash scripts/install.sh > "$OUT/install.log" 2>&1
  PY="$PWD/.venv/bin/python"
fi
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_ENABLE_TELEMETRY=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/torch.txt"
for batch in 8 64; do
  "$PY" tests/bench/bench_ppo.py --model smollm2 --device cuda --precision bf16 --batch "$batch" --new-tokens 32 \
    --epochs 4 --minibatches 1 --critic separate --iterations 4 --json "$OUT/bench-b$batch.json" \
    > "$OUT/bench-b$batch.log" 2>&1
  tail -8 "$OUT/bench-b$batch.log"
done
mkdir -p "$OUT/run" && cd "$OUT/run"
start=$(date +%s)
"$PY" -m flows.cli run "$OLDPWD/configs/default.yaml" > "$OUT/default-run.log" 2>&1
echo "default pipeline on CUDA: $(( $(date +%s) - start )) s wall" | tee "$OUT/default-run.txt"
tail -12 "$OUT/default-run.log"
"$PY" - "$OUT" <<'PY' | tee -a "$OUT/default-run.txt"
import glob, json, sys
from mlflow import MlflowClient
out = sys.argv[1]
client = MlflowClient(f"sqlite:///{out}/run/mlflow.db")
for run in client.search_runs([e.experiment_id for e in client.search_experiments()]):
    secs = run.data.metrics.get("seconds")
    print(f"{run.info.run_name:22s} {secs if secs is not None else (run.info.end_time - run.info.start_time) / 1000:.1f} s")
report = json.load(open(glob.glob(f"{out}/run/.rlhf/*/stages/evaluate/*/report.json")[0]))
for name in ("reference", "final"):
    r = report[name]
    print(name, {k: round(r[k], 3) for k in ("gold_reward", "proxy_reward", "kl_exact", "win_rate_gold") if r.get(k) is not None})
PY
