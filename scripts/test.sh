#!/usr/bin/env bash
# The test command: install, then the whole suite. Exit code 5 (no tests collected) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
. .venv/bin/activate
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_ENABLE_TELEMETRY=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
ruff check . || exit 1
python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
