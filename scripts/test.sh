#!/usr/bin/env bash
# The test command: install, then the whole suite. Exit code 5 (no tests collected) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
. .venv/bin/activate
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_ENABLE_TELEMETRY=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
ruff check . || exit 1
# two workers: most tests hold one core (torch runs 1 thread in tests, servers start, processes
# spawn); tests/conftest.py keeps each pipeline chain and each module in one worker
python -m pytest -q -n 2 --dist loadgroup "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
